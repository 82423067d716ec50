"""The README's two commands are what CI runs and what a newcomer pastes."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands():
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return [[line for line in block.splitlines() if line and not line.startswith("#")] for block in blocks[:2]]


def test_readme_opens_with_two_commands_that_make_their_own_venv():
    demo, tests = readme_commands()
    assert len(demo) == 1 and len(tests) == 1
    for command in (demo[0], tests[0]):
        assert command.startswith("python3 -m venv .venv && .venv/bin/pip install")
    assert "pytest" in tests[0]


def test_ci_runs_the_readme_test_command():
    _, tests = readme_commands()
    ci = (REPO / ".ci" / "run").read_text()
    assert tests[0] in ci.splitlines()
    assert "set -euo pipefail" in ci

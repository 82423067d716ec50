"""A torchrun worker leaves through `vlrft.parallel.process_exit.exit_process`: the exit code, the atexit handlers and
the buffered output all survive skipping the interpreter's teardown."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_exit_process_runs_atexit_handlers_flushes_output_and_keeps_the_code(tmp_path):
    marker = tmp_path / "atexit_ran"
    script = f"""
import atexit, logging, sys
from pathlib import Path
from vlrft.parallel.process_exit import exit_process
atexit.register(lambda: Path({str(marker)!r}).write_text("yes"))
logging.basicConfig(stream=sys.stderr)
logging.getLogger("run").warning("a log line")
sys.stdout.write("buffered, no newline")  # still in the buffer when exit_process is called
exit_process(3)
print("never printed")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 3
    assert proc.stdout == "buffered, no newline"
    assert "a log line" in proc.stderr
    assert marker.read_text() == "yes"


@pytest.mark.slow
def test_the_cli_exits_through_exit_process_only_under_torchrun(tmp_path):
    """`python -m vlrft` in a torchrun worker (LOCAL_RANK set) skips the teardown; elsewhere it returns normally."""
    probe = tmp_path / "probe.py"
    probe.write_text("""
import sys
import vlrft.parallel.process_exit as pe
called = []
pe.exit_process = lambda code: (called.append(code), print("exit_process", code), sys.exit(code))
from vlrft.cli import main
code = main()
print("returned", code, called)
""")
    for env_extra, expected in (({"LOCAL_RANK": "0"}, "exit_process 0"), ({}, "returned 0 []")):
        proc = subprocess.run([sys.executable, str(probe), "config", "--markdown"], capture_output=True, text=True,
                              timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **env_extra})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == expected

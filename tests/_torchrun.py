"""Launching a test worker under torchrun: the one way the distributed tests start processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# A worker dying of std::terminate in C++ (SIGABRT) after its last line of Python, at the interpreter's teardown
# (about one launch in 30 here, before the workers exited through vlrft.parallel.process_exit; CONTRIBUTING.md).
ABORT = "terminate called without an active exception"
# How long one launch may take before it counts as hung (VLRFT_TEST_TORCHRUN_TIMEOUT overrides). The longest plans
# (test_deepspeed's five ZeRO runs, with DeepSpeed building its shm op on first use) take 2-3 min on 2 idle cores;
# 600 s leaves room for a loaded CI machine, where 300 s timed out.
TIMEOUT_S = float(os.environ.get("VLRFT_TEST_TORCHRUN_TIMEOUT", 600))


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = TIMEOUT_S, cwd: Path | None = None,
             outputs: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """`torchrun --standalone` of tests/SCRIPT on `nproc` CPU processes; output captured.

    Standalone: the rendezvous takes a free port itself (no port picked here and released, which
    another job could take first). PYTHONFAULTHANDLER: a worker that dies of a signal prints every
    thread's Python stack, so the captured stderr says where it was. A launch that failed only by the
    `ABORT` above is run once more, after deleting those of `outputs` the first attempt created (a
    retry must not resume from them), with a warning carrying the first attempt's stderr; any other
    failure, or the abort twice, is returned as it is.
    """
    new = [Path(path) for path in outputs if not Path(path).exists()]  # a folder an earlier launch left stays
    proc = _launch(script, args, nproc, timeout, cwd)
    if proc.returncode != 0 and ABORT in proc.stderr:
        warnings.warn(f"torchrun {script}: a worker aborted ({ABORT!r}); retried once. First attempt's stderr:\n"
                      f"{failure_output(proc)}", RuntimeWarning, stacklevel=2)
        for path in new:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        proc = _launch(script, args, nproc, timeout, cwd)
    return proc


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's accelerator, when a worker uses it
    return env


def _launch(script: str, args: tuple[str, ...], nproc: int, timeout: float, cwd: Path | None
            ) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         str(REPO / "tests" / script), *args],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def start_vlrft(*args: str, nproc: int = 2, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`torchrun --standalone -m vlrft ARGS` started, not waited for (a fault test signals it); its output goes
    to `log`. The workers are torchrun's children (each in a session of its own)."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
             "-m", "vlrft", *args], cwd=REPO, env={**_env(), **(env or {})}, stdout=out, stderr=subprocess.STDOUT)


def children(pid: int) -> list[int]:
    """The pids of `pid`'s living children (from /proc: Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an ended child nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def failure_output(proc: subprocess.CompletedProcess) -> str:
    """The end of a failed launch's stderr, long enough for a fault handler's stack dump."""
    return proc.stderr[-12000:]


def run_outputs(runs: list[dict]) -> tuple[Path, ...]:
    """The output folders a plan's runs name (`train.output_dir=...` overrides)."""
    prefix = "train.output_dir="
    return tuple(Path(o[len(prefix):]) for run in runs for o in run.get("overrides", []) if o.startswith(prefix))


def run_plan(folder: Path, nproc: int, runs: list[dict]) -> list[dict]:
    """Run the trainings `runs` lists one after another in one launch of tests/fsdp_worker.py (any sharding
    strategy); each run's result (its metric history, or the error it was refused with), in order."""
    plan = folder / f"plan_{len(list(folder.glob('plan_*')))}.json"
    out = plan.with_suffix(".out.json")
    plan.write_text(json.dumps({"out": str(out), "runs": runs}))
    proc = torchrun("fsdp_worker.py", str(plan), nproc=nproc, outputs=(out, *run_outputs(runs)),
                    timeout=TIMEOUT_S)
    assert proc.returncode == 0, failure_output(proc)
    return json.loads(out.read_text())

"""Fault injection: a run SIGKILLed at random points (inside a checkpoint write, mid-prune, mid-metrics-line,
at random times) and stopped with Ctrl-C, again and again, then resumed, ends exactly where an uninterrupted
run ends: bitwise-equal weights, equal metrics, every step once in metrics.jsonl and TensorBoard, and the
folder of another run beside it untouched."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from vlrft.config import load_config
from vlrft.logging import read_metrics
from vlrft.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "fault_worker.py"
REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"
STEPS = 8

pytestmark = pytest.mark.slow


def write_config(path: Path, model: Path, shapes: dict, out: Path) -> Path:
    cfg = {"model": {"path": str(model), "dtype": "float32"},
           "data": {"train_files": [str(shapes["train"])], "min_pixels": 784, "max_pixels": 3136},
           "rollout": {"n": 2, "global_batch_completions": 4, "max_new_tokens": 4},
           "reward": {"functions": [{"name": f"{REWARDS}:text_hash"}]},
           "algorithm": {"kl_coef": 0.05},
           "train": {"output_dir": str(out), "total_steps": STEPS, "lr": 1e-3, "micro_batch_completions_per_rank": 4,
                     "save_every": 1, "keep_last": 2, "resume": "auto"},
           "logging": {"progress": False, "completions_every": 0, "tensorboard": True}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(config: Path, fault: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "VLRFT_CACHE_DIR": str(cache),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, str(WORKER), fault, "train", str(config)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(read_metrics(out)) if path.exists() else 0


def wait_then_signal(proc: subprocess.Popen, out: Path, sig: int, delay: float) -> None:
    """Once the run has logged a new step, wait `delay` seconds and send `sig` (unless it finished)."""
    seen = logged_steps(out)
    deadline = time.time() + 120
    while proc.poll() is None and logged_steps(out) <= seen and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(sig)


def tensorboard_steps(out: Path, tag: str = "reward/mean") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def without_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def ctrl_c_during_step(config: Path, nth: int) -> str:
    """Resume the run in this process and press Ctrl-C (a real SIGINT) during its `nth` step."""
    from vlrft.config import load_config
    from vlrft.trainer import Trainer
    from vlrft.trainer import trainer as trainer_module
    from vlrft.trainer.interrupt import TrainingInterrupted

    real, calls = trainer_module.make_experience, []

    def make_experience(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    trainer_module.make_experience = make_experience
    try:
        Trainer(load_config(config)).fit()
        return "finished"
    except TrainingInterrupted as stopped:
        assert "checkpoint saved" in str(stopped)
        return "saved and stopped"
    finally:
        trainer_module.make_experience = real


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=16, test_size=4))


@pytest.fixture
def one_thread():
    """The runs in this process use one thread, as the killed subprocesses do (OMP_NUM_THREADS=1): float results
    depend on the thread count, and bitwise comparisons need the same one everywhere."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_killed_and_interrupted_runs_resume_to_the_uninterrupted_result(tmp_path, tiny_vlm_dir, shapes, one_thread):
    model = Path(tiny_vlm_dir())
    cache = tmp_path / "cache"
    straight = tmp_path / "straight"  # the uninterrupted reference, in this process
    Trainer(load_config(write_config(tmp_path / "a.yaml", model, shapes, straight))).fit()

    other = tmp_path / "other_run"  # another run's folder beside ours: nothing may touch it
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    other_before = {p: p.stat().st_mtime_ns for p in other.rglob("*")}

    out = tmp_path / "faulty"
    config = write_config(tmp_path / "b.yaml", model, shapes, out)
    rng = random.Random(0)
    faults = [("kill-in-save:2", None), ("kill-in-prune", None), ("Ctrl-C", signal.SIGINT), ("kill-in-log:7", None),
              ("random SIGKILL", signal.SIGKILL)]
    outcomes = []
    for name, sig in faults:
        if sig == signal.SIGINT:  # in this process (no start-up cost): Ctrl-C in the middle of a random step
            outcomes.append((name, ctrl_c_during_step(config, rng.choice([1, 2]))))
            continue
        proc = start(config, name if sig is None else "none", cache)
        if sig is not None:
            wait_then_signal(proc, out, sig, rng.uniform(0.0, 1.0))
        code = proc.wait(timeout=300)
        log = proc.stdout.read()
        assert "Traceback" not in log, log
        outcomes.append((name, code))
    assert sum(code == -signal.SIGKILL for _, code in outcomes) >= 3, outcomes  # the faults really happened

    Trainer(load_config(config)).fit()  # the final resume, in this process

    a = load_file(straight / "checkpoints" / f"step_{STEPS}" / "model" / "model.safetensors")
    b = load_file(out / "checkpoints" / f"step_{STEPS}" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), outcomes
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), outcomes
    assert without_times(metrics) == without_times(read_metrics(straight))
    assert tensorboard_steps(out) == list(range(1, STEPS + 1)) == tensorboard_steps(straight)
    assert not list((out / "checkpoints").glob(".*")), "leftover temporary checkpoint folders"
    assert {p: p.stat().st_mtime_ns for p in other.rglob("*")} == other_before
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == STEPS


@pytest.mark.distributed
def test_workers_end_with_their_killed_launcher_and_a_live_run_keeps_its_folder(tmp_path, tiny_vlm_dir, shapes,
                                                                                capsys):
    """SIGKILL of the torchrun parent alone: its workers (each in a session of its own) trained on to the end,
    writing checkpoints into a folder a relaunch then shared. Now a relaunch into the folder while the workers
    live is refused naming rank 0's host and pid; the workers end within a few seconds of their launcher; the
    hold they left is taken over as stale."""
    import socket

    from _torchrun import alive, children, start_vlrft
    from vlrft.cli import main
    from vlrft.trainer.run_folder import HOLD_FILE, RunHold

    out = tmp_path / "run"
    config = write_config(tmp_path / "ddp.yaml", Path(tiny_vlm_dir()), shapes, out)
    launcher = start_vlrft("train", str(config), "train.strategy=ddp", "train.total_steps=1000",
                           "rollout.global_batch_completions=4", log=tmp_path / "torchrun.log",
                           env={"VLRFT_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.time() + 300
        while logged_steps(out) < 1 and launcher.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert logged_steps(out) >= 1, (tmp_path / "torchrun.log").read_text()[-4000:]
        workers = children(launcher.pid)
        holder = json.loads((out / HOLD_FILE).read_text())
        assert len(workers) == 2 and holder["pid"] in workers and holder["host"] == socket.gethostname()
        capsys.readouterr()
        # a relaunch while the run lives: refused, naming it; nothing of the folder touched. The live workers are
        # paused meanwhile (still alive to the hold's check), so only the relaunch could change the folder: the
        # live run itself rotates its checkpoints.
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
            assert main(["train", str(config), "train.resume=auto"]) == 2
            after = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and f"is in use by a live run: pid {holder['pid']} on host {holder['host']}" in err[0], err
        assert after == before, "the refused relaunch touched the run's folder"
        launcher.send_signal(signal.SIGKILL)  # the launcher alone
        launcher.wait()
        killed = time.monotonic()
        while any(alive(pid) for pid in workers) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        outlived = time.monotonic() - killed
        assert not any(alive(pid) for pid in workers), "workers outlived their launcher by 30 s"
        assert outlived < 5, f"the workers outlived their launcher by {outlived:.1f} s"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in children(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    # The hold: left behind if rank 0 was killed first (stale: taken over, with a message), or given back by rank 0
    # when the collective with its killed peer failed. Either way the next run starts.
    left = (out / HOLD_FILE).exists()
    messages = []
    RunHold(out, messages.append).acquire()
    assert not left or f"took over the hold of a run that is gone (pid {holder['pid']} on host {holder['host']}" \
        in messages[0], messages

"""tools/gpu_bench.py runs end to end on CPU with --tiny (the GPU figures need a GPU machine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_bench_tiny_smoke(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "tools/gpu_bench.py", "--tiny", "--steps", "2", "--out", str(tmp_path),
                           "--json", str(out), "--strategies", "single,no-such-strategy"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no-such-strategy: skipped" in done.stdout
    (result,) = json.loads(out.read_text())
    assert result["strategy"] == "single" and result["steps"] == 2
    assert result["rollout_tokens_per_s"] > 0 and result["train_tokens_per_s"] > 0
    assert result["peak_memory_bytes"] > 0 and result["plan_train_bytes"] > 0
    assert result["parameters"] == result["trained_parameters"]  # the plan counts what the trainer trains


def test_peaks_by_phase_credit_each_phase_with_what_was_allocated_while_it_was_open(monkeypatch):
    """gpu_bench reports CUDA memory peaks per trainer phase (time/generate, time/train, ...) to set beside the plan's
    rollout and train figures. The allocator's counters are a stand-in here (MOCK: no CUDA device on this machine);
    the phases are the trainer's own `timer` contexts, nested as in a step (the reward inside the generation)."""
    import contextlib
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(REPO / "tools"))
    import gpu_bench

    allocator = {"now": 0, "peak": 0}  # MOCK of torch.cuda's allocated-bytes counters

    def allocate(size):
        allocator["now"] += size
        allocator["peak"] = max(allocator["peak"], allocator["now"])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: allocator.update(peak=allocator["now"]))
    trainer = SimpleNamespace(device="cuda:0", timer=lambda name: contextlib.nullcontext())
    peaks = gpu_bench.watch_phase_peaks(trainer)
    allocate(10)  # between phases
    with trainer.timer("time/generate"):
        allocate(50)
        with trainer.timer("time/reward"):
            allocate(30)
            allocate(-30)
        allocate(-50)
    with trainer.timer("time/train"):
        allocate(70)
        allocate(-70)
    allocate(5)
    assert peaks() == {"between": 15, "time/generate": 90, "time/reward": 90, "time/train": 80}

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

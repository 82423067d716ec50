"""Two processes under torchrun (gloo on CPU): the same training code path, ranks kept in step."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed


def test_ddp_training_keeps_ranks_identical_and_reduces_metrics(tmp_path, tiny_vlm_dir):
    from vlrft.data.synthetic import ShapesSpec, make_shapes

    data = make_shapes(tmp_path / "data", ShapesSpec(train_size=16, test_size=6))
    cfg = tmp_path / "ddp.yaml"
    cfg.write_text(f"""
model: {{path: {tiny_vlm_dir('qwen2_vl')}, dtype: float32}}
data: {{train_files: [{data['train']}], eval_files: [{data['test']}], min_pixels: 784, max_pixels: 3136}}
rollout: {{n: 4, global_batch_completions: 16, max_new_tokens: 4}}
reward: {{functions: [{{name: exact_match}}]}}
train: {{output_dir: {tmp_path / 'run'}, total_steps: 2, lr: 1.0e-3, micro_batch_completions_per_rank: 4, eval_every: 2, strategy: ddp}}
logging: {{progress: false, completions_every: 0}}
""")
    out = tmp_path / "result.json"
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
         str(REPO / "tests" / "dist_train_worker.py"), str(cfg), str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # gradients were all-reduced: identical weights
    assert ranks[0]["rows"] == ranks[1]["rows"] == 2  # 4 prompts per step split into whole groups per rank
    steps = [h for h in result["history"] if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    # eval runs on both ranks' halves of the 6 eval prompts and is reduced exactly: 6 prompts x 1 sample
    evals = [h for h in result["history"] if "eval/accuracy" in h]
    assert len(evals) == 2 and all(0 <= h["eval/accuracy"] <= 1 for h in evals)
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "rng" / "rank1.pt").is_file()

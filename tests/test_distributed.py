"""Two processes under torchrun (gloo on CPU): the same training code path, ranks kept in step."""

import json
from pathlib import Path

import pytest

from _torchrun import failure_output, torchrun

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed


def ddp_config(tmp_path, tiny_vlm_dir, data, *, reward: str, rollout: str, train: str, logging: str) -> Path:
    """A 2-rank DDP run's config (tiny Qwen2-VL, the shapes `data`, one reward of tests/data/trainer_rewards.py);
    `rollout`, `train` and `logging` are the inside of their YAML flow mappings."""
    cfg = tmp_path / "ddp.yaml"
    cfg.write_text(f"""
model: {{path: {tiny_vlm_dir('qwen2_vl')}, dtype: float32}}
data: {{train_files: [{data['train']}], eval_files: [{data['test']}], min_pixels: 784, max_pixels: 3136}}
rollout: {{{rollout}}}
reward: {{functions: [{{name: '{REPO / 'tests' / 'data' / 'trainer_rewards.py'}:{reward}'}}]}}
train: {{output_dir: {tmp_path / 'run'}, strategy: ddp, {train}}}
logging: {{{logging}}}
""")
    return cfg


def test_ddp_training_keeps_ranks_identical_and_reduces_metrics(tmp_path, tiny_vlm_dir):
    from examples.shapes import ShapesSpec, make_shapes

    data = make_shapes(tmp_path / "data", ShapesSpec(train_size=16, test_size=6))
    cfg = ddp_config(tmp_path, tiny_vlm_dir, data, reward="text_hash",
                     rollout="n: 4, global_batch_completions: 16, max_new_tokens: 4",
                     train="total_steps: 2, lr: 1.0e-3, micro_batch_completions_per_rank: 4, eval_every: 2",
                     logging="progress: false, completions_every: 0")
    out = tmp_path / "result.json"
    proc = torchrun("dist_train_worker.py", str(cfg), str(out), cwd=tmp_path, timeout=600,
                    outputs=(out, tmp_path / "run"))
    assert proc.returncode == 0, failure_output(proc)
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


@pytest.mark.slow
def test_two_ranks_give_the_weights_of_one_process_with_the_same_global_batch(tmp_path, tiny_vlm_dir):
    """Whole groups per rank, loss denominators and batch whitening reduced over ranks: DDP changes nothing.

    Greedy rollouts make each prompt's completions the same on any rank; the reward depends on the
    prompt's reference and REINFORCE++ whitens over the global batch, so the advantages are not zero
    although every group's completions agree.
    """
    from safetensors.torch import load_file

    from vlrft.config import load_config
    from examples.shapes import ShapesSpec, make_shapes
    from vlrft.trainer import Trainer

    data = make_shapes(tmp_path / "data", ShapesSpec(train_size=16, test_size=4))
    rewards = REPO / "tests" / "data" / "trainer_rewards.py"
    text = f"""
model: {{path: {tiny_vlm_dir('qwen2_vl')}, dtype: float32}}
data: {{train_files: [{data['train']}], min_pixels: 784, max_pixels: 3136}}
rollout: {{n: 2, global_batch_completions: 8, max_new_tokens: 4, temperature: 0.0}}
reward: {{functions: [{{name: '{rewards}:reference_hash'}}]}}
algorithm: {{advantage: reinforce_pp}}
train: {{output_dir: OUT, total_steps: 1, lr: 1.0e-3, micro_batch_completions_per_rank: 2, eval_every: 0,
        eval_before_training: false, max_grad_norm: 1.0e9, strategy: STRATEGY}}
logging: {{progress: false, completions_every: 0, tensorboard: false}}
"""
    single_cfg = tmp_path / "single.yaml"
    single_cfg.write_text(text.replace("OUT", str(tmp_path / "single")).replace("STRATEGY", "single"))
    Trainer(load_config(single_cfg)).fit()
    ddp_cfg = tmp_path / "ddp.yaml"
    ddp_cfg.write_text(text.replace("OUT", str(tmp_path / "ddp")).replace("STRATEGY", "ddp"))
    proc = torchrun("dist_train_worker.py", str(ddp_cfg), str(tmp_path / "result.json"), cwd=tmp_path, timeout=600,
                    outputs=(tmp_path / "result.json", tmp_path / "ddp"))
    assert proc.returncode == 0, failure_output(proc)

    start = load_file(tiny_vlm_dir("qwen2_vl") / "model.safetensors")
    one = load_file(tmp_path / "single" / "checkpoints" / "step_1" / "model" / "model.safetensors")
    two = load_file(tmp_path / "ddp" / "checkpoints" / "step_1" / "model" / "model.safetensors")
    assert one.keys() == two.keys()
    assert int((one["lm_head.weight"] != start["lm_head.weight"]).sum()) > 1000  # the step moved the weights
    # Adam's first step moves a weight by lr * g / (|g| + 1e-8): identical wherever the gradient is above
    # float32 summation noise; the few weights whose gradient is ~1e-9 may differ by a small fraction of lr.
    lr = 1e-3
    total = sum(v.numel() for v in one.values())
    off = sum(int(((one[k] - two[k]).abs() > 1e-3 * lr).sum()) for k in one)
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert off <= total * 1e-4 and worst < 0.05 * lr, f"{off} of {total} weights differ, by up to {worst / lr:.2e} lr"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_rank_waiting_longer_than_train_dist_timeout_minutes_fails_instead_of_hanging(tmp_path, strategy):
    # torch's gloo default would wait 30 min here; the config's 0.04 min (2.4 s) must be what the groups use.
    out = tmp_path / "timeout"
    proc = torchrun("timeout_worker.py", str(out), strategy, "0.04", timeout=120)
    assert proc.returncode == 0, failure_output(proc)
    waiting = json.loads(Path(f"{out}.rank1.json").read_text())
    assert len(waiting["timeouts_s"]) >= 2 and all(abs(t - 2.4) < 1e-6 for t in waiting["timeouts_s"]), waiting
    assert waiting["error"] is not None and "timed out" in waiting["error"].lower(), waiting
    assert 2.0 < waiting["waited_s"] < 6.0, waiting  # rank 0 came back only after 7.2 s


@pytest.mark.parametrize("phase", ["train", "eval"])
def test_a_reward_failing_on_one_rank_stops_every_rank_with_its_message(tmp_path, tiny_vlm_dir, phase):
    """With reward.on_error=raise, a reward that fails on rank 1 alone is raised on every rank, naming the rank and
    the function, instead of rank 0 waiting in the next collective until the launcher stops it without a word; in
    a training step's scoring and in evaluation alike."""
    from examples.shapes import ShapesSpec, make_shapes

    data = make_shapes(tmp_path / "data", ShapesSpec(train_size=16, test_size=4))
    cfg = ddp_config(tmp_path, tiny_vlm_dir, data, reward="broken_on_rank_1",
                     rollout="n: 2, global_batch_completions: 8, max_new_tokens: 3",
                     train=f"total_steps: 1, micro_batch_completions_per_rank: 4, eval_before_training: "
                           f"{str(phase == 'eval').lower()}, eval_every: 0, dist_timeout_minutes: 0.5",
                     logging="progress: false, completions_every: 0, tensorboard: false")
    out = tmp_path / "raised"
    proc = torchrun("reward_failure_worker.py", str(cfg), str(out), cwd=tmp_path)
    assert proc.returncode == 0, failure_output(proc)
    for rank in (0, 1):
        raised = Path(f"{out}.rank{rank}.txt").read_text()
        assert raised.startswith("RewardError: rank 1: reward function 'broken_on_rank_1'"), (rank, raised)
        assert "grader crashed on rank 1" in raised
        assert f"in {'evaluate' if phase == 'eval' else 'collect'}" in raised  # raised in the phase under test


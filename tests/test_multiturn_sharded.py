"""Multi-turn rollouts with tool images under sharded training (torchrun, 2 processes, gloo on CPU).

Under FSDP2 and DeepSpeed ZeRO-3 every vision block gathers its weights from all ranks when it
runs, so every rank must run the vision tower equally often in each forward, and enter the
engine's "whole weights" context (a gather) equally often. Here the ranks' trajectories differ on
purpose: prompts whose id starts with "zoom" get a zoomed image from the tool on their first call
and take three turns; the others end after one turn, with no tool image
(`tests/data/multiturn_tools.py:zoom_for_zoom_ids`). With 4 prompts per step over 2 ranks
(contiguous shares, no shuffling), step 1 gives rank 0 two zoom prompts and rank 1 none; step 2
gives each rank one of each, in opposite order (micro-batch 4 = one prompt per micro-batch).

The rollouts come from the `ScriptedEngine` test double inside the real multi-turn engine, so a
2-rank run and a single-process run (which never balances: nothing to agree with) see the same
trajectories; the weights after each step must agree. One run uses the hf engine, whose every turn
generates with the gathered policy.
"""

import json
import time
from pathlib import Path

import pytest

from _sharded_runs import assert_close, assert_runs_match_single, needs_deepspeed, weights
from _torchrun import run_plan

TOOLS = Path(__file__).parent / "data" / "multiturn_tools.py"
REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_vlm_dir):
    from examples.shapes import ShapesSpec, make_shapes

    folder = tmp_path_factory.mktemp("mt_sharded")
    data = make_shapes(folder / "data", ShapesSpec(train_size=8, test_size=2))
    rows = [json.loads(r) for r in Path(data["train"]).read_text().splitlines()]
    # Z = the tool returns an image, N = the trajectory ends at its first call; every prompt has an image
    kinds = "ZZNNZNNZ"
    mixed = folder / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({**row, "id": f"{'zoom' if k == 'Z' else 'plain'}-{i}",
                                         "images": [str(Path(data["train"]).parent / row["images"][0])]}) + "\n"
                             for i, (k, row) in enumerate(zip(kinds, rows))))
    model = tiny_vlm_dir("qwen2_vl", tie_word_embeddings=True)
    stops = ",".join(str(i) for i in range(100, 160))  # the hf engine's untrained turns stay short
    config = folder / "base.yaml"
    config.write_text(f"""
model: {{path: {model}, dtype: float32}}
data: {{train_files: [{mixed}], shuffle: false, min_pixels: 784, max_pixels: 3136}}
rollout: {{n: 4, global_batch_completions: 16, max_new_tokens: 5, stop_token_ids: [{stops}],
          tools: [{{name: '{TOOLS}:zoom_for_zoom_ids', alias: look}}], tool_parser: '{TOOLS}:always_call', max_turns: 3,
          max_trajectory_tokens: 300}}
reward: {{functions: [{{name: '{REWARDS}:text_hash'}}]}}
algorithm: {{kl_coef: 0.1}}
train: {{total_steps: 2, lr: 1.0e-3, micro_batch_completions_per_rank: 4, strategy: fsdp2, save_every: 1,
         keep_last: 5, eval_every: 0}}
logging: {{progress: false, completions_every: 0, tensorboard: false}}
""")
    return {"folder": folder, "config": str(config), "model": model}


def _run(setup, name: str, *overrides: str, **extra) -> dict:
    return {"config": setup["config"], "overrides": [f"train.output_dir={setup['folder'] / name}", *overrides], **extra}


PPO = ["algorithm.advantage=gae", "train.total_steps=1"]  # a critic: its forward encodes every image in one pass


@pytest.fixture(scope="module")
def single(setup) -> list[dict]:
    """The run in this process (strategy single: nothing balanced), with the same scripted multi-turn rollouts;
    its history (its checkpoints are in MT-single)."""
    return _single(setup, "MT-single")


@pytest.fixture(scope="module")
def single_ppo(setup) -> list[dict]:
    return _single(setup, "MTPPO-single", *PPO)


def _single(setup, name: str, *overrides: str) -> list[dict]:
    from scripted_engine import scripted_engine

    from vlrft.config import load_config
    from vlrft.trainer import Trainer

    cfg = load_config(setup["config"], [f"train.output_dir={setup['folder'] / name}", "train.strategy=single",
                                        *overrides])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlrft.trainer.trainer.make_engine", scripted_engine)
        return Trainer(cfg).fit()


def test_ranks_with_and_without_tool_images_train_like_one_process(setup, single, single_ppo):
    """FSDP2: a rank whose trajectories got no tool image runs the tower on a dummy (experience and update passes);
    weights, gradient norms and KL equal the single-process run, also with a critic (PPO); the hf engine's turns
    do not hang either."""
    folder = setup["folder"]
    start = time.perf_counter()
    results = run_plan(folder, 2, [_run(setup, "MT4"),
                                   _run(setup, "MT8", "train.micro_batch_completions_per_rank=8"),
                                   _run(setup, "MTPPO", *PPO),
                                   _run(setup, "MTHF", "train.total_steps=1", scripted=False)])
    seconds = time.perf_counter() - start
    hf_run = results.pop()
    hf = hf_run["history"]
    _assert_same_ppo(setup, "MTPPO", results.pop()["history"], single_ppo)
    assert hf[-1]["step"] == 1 and hf[-1]["tools/calls"] > 0 and hf[-1]["actor/grad_norm"] > 0
    assert hf_run["lean_decode_steps"] > 0  # the unsharded FSDP2 weights are whole tensors: the lean step decodes
    assert all(h["tools/images_returned"] > 0 for h in single)
    assert_runs_match_single(setup, "MT-single", ("MT4", "MT8"), steps=(1, 2))
    for run in results:
        _assert_same_history(run["history"], single)
    assert seconds < 240, seconds  # finished (a hang would hit the torchrun timeout)


def _assert_same_ppo(setup, run: str, ours: list[dict], theirs: list[dict]) -> None:
    assert_close(weights(setup, run, 1), weights(setup, "MTPPO-single", 1))
    _assert_same_history(ours, theirs)
    assert ours[0]["critic/value_loss"] == pytest.approx(theirs[0]["critic/value_loss"], rel=1e-4)


def _assert_same_history(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for mine, one in zip(ours, theirs):
        assert mine["tools/turns"] == one["tools/turns"] and mine["tools/images_returned"] > 0
        assert mine["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-4)
        assert mine["actor/kl_ref"] == pytest.approx(one["actor/kl_ref"], rel=1e-4, abs=1e-7)


@needs_deepspeed
def test_zero3_ranks_with_and_without_tool_images_train_like_one_process(setup, single, single_ppo):
    """DeepSpeed ZeRO-3 (policy, reference, critic), the same trajectories: weights equal one process; the hf
    engine's turns (generation from the gathered ZeRO-3 policy) do not hang."""
    folder = setup["folder"]
    # one step: rank 0's rows all got tool images, rank 1's none (the FSDP2 test also runs step 2, mixed)
    zero3 = ["train.strategy=deepspeed", "train.total_steps=1"]
    results = run_plan(folder, 2, [_run(setup, "MTZ3", *zero3),
                                   _run(setup, "MTZ3H", *zero3, scripted=False),
                                   _run(setup, "MTZ3PPO", *zero3, *PPO)])
    _assert_same_ppo(setup, "MTZ3PPO", results[2]["history"], single_ppo)
    hf = results[1]["history"]
    assert hf[-1]["step"] == 1 and hf[-1]["tools/calls"] > 0 and hf[-1]["actor/grad_norm"] > 0
    assert results[1]["lean_decode_steps"] > 0  # the gathered ZeRO-3 weights are whole: the lean step decodes
    assert_close(weights(setup, "MTZ3", 1), weights(setup, "MT-single", 1))
    _assert_same_history(results[0]["history"], single[:1])

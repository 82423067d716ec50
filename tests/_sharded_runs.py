"""What the sharded-training tests share (test_fsdp2, test_deepspeed, test_multiturn_sharded): one tiny run's config,
its launch arguments, its saved weights, the same run in one process, and the comparisons between them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


def deepspeed_import_error() -> str | None:
    """Why deepspeed cannot be imported here, or None."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import
        return f"deepspeed cannot be imported ({exc!r}); install it with pip install 'vlrft[deepspeed]'"
    return None


needs_deepspeed = pytest.mark.skipif(deepspeed_import_error() is not None, reason=str(deepspeed_import_error()))


def sharded_setup(folder: Path, model: str, strategy: str) -> dict:
    """A 3-step run of the tiny model on 16 shapes prompts (4 per group) with `strategy`, saving every step."""
    from examples.shapes import ShapesSpec, make_shapes

    data = make_shapes(folder / "data", ShapesSpec(train_size=16, test_size=4))
    config = folder / "base.yaml"
    config.write_text(f"""
model: {{path: {model}, dtype: float32}}
data: {{train_files: [{data['train']}], eval_files: [{data['test']}], min_pixels: 784, max_pixels: 3136}}
rollout: {{n: 4, global_batch_completions: 16, max_new_tokens: 5}}
reward: {{functions: [{{name: '{REWARDS}:text_hash'}}]}}
train: {{total_steps: 3, lr: 1.0e-3, micro_batch_completions_per_rank: 4, strategy: {strategy}, save_every: 1, keep_last: 5,
         eval_before_training: false}}
logging: {{progress: false, completions_every: 0, tensorboard: false}}
""")
    return {"folder": folder, "config": str(config), "model": model}


def run_args(setup: dict, name: str, *overrides: str, **extra) -> dict:
    """One run of a torchrun plan (tests/_torchrun.run_plan): the setup's config, written to its folder / `name`."""
    return {"config": setup["config"], "overrides": [f"train.output_dir={setup['folder'] / name}", *overrides], **extra}


def weights(setup: dict, run: str, step: int) -> dict[str, torch.Tensor]:
    """The Hugging Face weights a run saved at `step`."""
    return load_file(setup["folder"] / run / "checkpoints" / f"step_{step}" / "model" / "model.safetensors")


def single_process_run(setup: dict, name: str = "S") -> dict:
    """The setup's run in this process (strategy single), with the scripted completions the sharded runs get."""
    from scripted_engine import ScriptedEngine

    from vlrft.config import load_config
    from vlrft.trainer import Trainer

    cfg = load_config(setup["config"], [f"train.output_dir={setup['folder'] / name}", "train.strategy=single"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlrft.trainer.trainer.make_engine", lambda cfg, trainer: ScriptedEngine(trainer))
        trainer = Trainer(cfg)
        history = trainer.fit()
    return {"trainer": trainer, "history": history}


def assert_close(a: dict, b: dict, atol: float = 1e-5) -> None:
    """Equal within float tolerance: 1 % of one AdamW step at lr 1e-3 (sums over ranks round differently)."""
    assert sorted(a) == sorted(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, worst


def assert_runs_match_single(setup: dict, single: str, runs: tuple[str, ...], steps: tuple[int, ...]) -> None:
    """Each run's weights equal the one-process run `single` after each step, and the images trained the vision
    tower (so a dummy-image path that silently dropped them would fail)."""
    initial = load_file(Path(setup["model"]) / "model.safetensors")
    for step in steps:
        one = weights(setup, single, step)
        for run in runs:
            assert_close(weights(setup, run, step), one)
        tower = [k for k in one if "visual." in k]
        assert max((one[k] - initial[k]).abs().max().item() for k in tower) > 1e-4


def assert_sync_sends_the_single_process_state_dict(setup: dict, single: dict, run: str, step: int) -> None:
    """A sharded run's weight sync (saved to `sync.pt` by the worker) sent exactly the one-process policy's
    weights: every name once, the tied LM head under its embedding's name, and the very tensors `run` saved at
    `step` (the sync gathers what the checkpoint gathers)."""
    from vlrft.models.weights import PolicyWeights

    sent = torch.load(setup["folder"] / "sync.pt")
    assert sent["duplicates"] == []
    expected = {name: t for bucket in PolicyWeights(single["trainer"].actor, torch.float32).buckets(1 << 30, "cpu")
                for name, t in bucket}
    assert "lm_head.weight" not in sent["received"]  # tied to the embedding: sent once, under its name
    assert_close(sent["received"], expected)
    saved = weights(setup, run, step)
    assert sorted(saved) == sorted(sent["received"])
    assert all(torch.equal(sent["received"][k], saved[k]) for k in saved)

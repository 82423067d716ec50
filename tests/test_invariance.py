"""Trainer-level invariances (in the spirit of TRL's tests/invariant): settings that must not change the update.

One optimizer step from the same rollouts must give the same weights whatever the micro-batch
size (loss denominators cover the whole mini-batch), and the on-policy shortcut (one epoch over
one mini-batch skips the old-logprob pass, ratio 1 by construction) must give the same weights
as computing the old logprobs and a ratio that equals 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlrft.config import load_config
from vlrft.trainer import Trainer

REWARDS = Path(__file__).parent / "data" / "trainer_rewards.py"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from examples.shapes import ShapesSpec, make_shapes

    return make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=16, test_size=4))


def one_step(tmp_path, model_dir, shapes, *overrides) -> tuple[Trainer, dict[str, torch.Tensor], dict]:
    """Weights before and after one training step with these overrides (same seed, same rollouts)."""
    cfg = load_config(None, [
        f"model.path={model_dir}", "model.dtype=float32", f"data.train_files=[{shapes['train']}]",
        "data.min_pixels=784", "data.max_pixels=3136", "rollout.n=4", "rollout.global_batch_completions=16",
        "rollout.max_new_tokens=6", f"reward.functions=[{{name: '{REWARDS}:text_hash'}}]",
        f"train.output_dir={tmp_path / 'run'}", "train.total_steps=1", "train.lr=1e-3", "train.eval_every=0",
        "train.eval_before_training=false", "logging.progress=false", "logging.tensorboard=false",
        "train.max_grad_norm=1e9",  # no clipping: it would hide a gradient that is off by a constant factor
        *overrides])
    trainer = Trainer(cfg)
    names = {id(p): k for k, p in trainer.actor.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def keep_gradients(optimizer, args, kwargs):  # the accumulated gradient the optimizer is about to apply
        for group in optimizer.param_groups:
            grads.update({names[id(p)]: p.grad.detach().clone() for p in group["params"] if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(keep_gradients)
    before = {k: v.detach().clone() for k, v in trainer.actor.named_parameters()}
    metrics = trainer.train_step()
    after = {k: v.detach().clone() for k, v in trainer.actor.named_parameters()}
    return {k: after[k] - before[k] for k in before}, grads, metrics, trainer


def assert_same_step(a, b, lr: float = 1e-3) -> None:
    """Same gradient (up to float32 summation order) and so the same weights after the step."""
    (update_a, grads_a), (update_b, grads_b) = a[:2], b[:2]
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    scale = max(float(g.abs().max()) for g in grads_a.values())
    assert scale > 0, "no gradient: the comparison would be vacuous"
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=1e-4, atol=1e-5 * scale, msg=k)
    # Adam's first step moves each weight by lr * g / (|g| + 1e-8): the same weights wherever the gradient
    # is clearly above float32 summation noise; a gradient of ~1e-9 moves by an arbitrary fraction of lr.
    for k in update_a:
        clear = grads_a[k].abs() > 1e-7
        torch.testing.assert_close(update_a[k][clear], update_b[k][clear], rtol=0, atol=1e-3 * lr, msg=k)
        assert float((update_a[k] - update_b[k]).abs().max()) <= 2 * lr  # never more than Adam's bound


def test_micro_batch_size_does_not_change_the_update(tmp_path, tiny_vlm_dir, shapes):
    model = tiny_vlm_dir("qwen2_vl")
    one = one_step(tmp_path / "a", model, shapes, "train.micro_batch_completions_per_rank=1")
    eight = one_step(tmp_path / "b", model, shapes, "train.micro_batch_completions_per_rank=8")
    assert_same_step(one, eight)


def test_on_policy_shortcut_skips_the_old_logprob_pass_and_matches_the_ratio_one_path(tmp_path, tiny_vlm_dir,
                                                                                     shapes, monkeypatch):
    import vlrft.trainer.experience as experience

    calls = []
    original = experience.forward_pass
    monkeypatch.setattr(experience, "forward_pass", lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    model = tiny_vlm_dir("qwen2_vl")
    on_policy = ["train.global_mini_batch_completions=16", "train.ppo_epochs=1"]
    shortcut = one_step(tmp_path / "a", model, shapes, *on_policy)
    assert not shortcut[3].needs_old_logprobs and calls == []  # no extra forward pass at all

    original_init = Trainer.__init__

    def forced(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.needs_old_logprobs = True  # the off-policy path: old logprobs from a separate pass

    monkeypatch.setattr(Trainer, "__init__", forced)
    explicit = one_step(tmp_path / "b", model, shapes, *on_policy)
    assert len(calls) == 1  # the old-logprob pass ran
    assert explicit[2].get("clip_ratio/region", 0.0) == 0.0  # ratio 1: nothing clipped
    assert_same_step(shortcut, explicit)

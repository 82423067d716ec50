"""The policy (and critic) update: PPO epochs over mini-batches, gradient accumulation over micro-batches.

Loss denominators cover the whole mini-batch over all ranks, so accumulation is exact whatever
the micro-batch size (see `vlrft.algo.losses`). A non-finite loss or gradient on any rank skips
the optimizer step on every rank: the decision is all-reduced before anyone steps, and the
gradients are dropped, never applied.
"""

from __future__ import annotations

import contextlib

import torch

from vlrft.algo import Stats, loss_denominators, policy_loss, value_loss
from vlrft.errors import UserError
from vlrft.trainer.experience import Experience, micro_batches, sequences_for


def _slice(t: torch.Tensor | None, rows: list[int], width: int, device) -> torch.Tensor | None:
    return None if t is None else t[rows, :width].to(device)


def update(trainer, collected, exp: Experience) -> tuple[Stats, int]:
    """Run `train.ppo_epochs` passes; returns the loss statistics and how many optimizer steps were skipped."""
    cfg = trainer.cfg
    world = trainer.strategy.world_size
    n_rows = len(collected.rollouts)
    mini_size = trainer.mini_batch_per_rank
    stats = Stats()
    skipped = 0
    for _epoch in range(cfg.train.ppo_epochs):
        for start in range(0, n_rows, mini_size):
            mini = list(range(start, min(start + mini_size, n_rows)))
            den = loss_denominators(exp.mask[mini], reduce=trainer.sum_reduce)
            nonfinite = False
            micro = micro_batches(mini, cfg.train.micro_batch_size)
            for i, rows in enumerate(micro):
                seqs = sequences_for(trainer, collected, rows)
                width = seqs.completion_width
                sync = contextlib.nullcontext() if i == len(micro) - 1 else trainer.strategy.no_sync(trainer.wrapped)
                with sync:
                    with trainer.autocast():
                        out = trainer.wrapped(seqs, trainer.train_temperature)
                    mask = _slice(exp.mask, rows, width, trainer.device)
                    old = _slice(exp.old_logprobs, rows, width, trainer.device)
                    result = policy_loss(
                        cfg.algorithm, out.logprobs, out.logprobs.detach() if old is None else old,
                        _slice(exp.advantages, rows, width, trainer.device), mask, entropy=out.entropy,
                        engine_logprobs=_slice(exp.engine_logprobs, rows, width, trainer.device),
                        ref_logprobs=_slice(exp.ref_logprobs, rows, width, trainer.device),
                        kl_coef=trainer.kl_controller.value, num_tokens=den.num_tokens, num_seqs=den.num_seqs,
                        max_tokens=cfg.rollout.max_new_tokens, world_size=world)
                    trainer.strategy.backward(result.loss, trainer.wrapped)
                nonfinite |= not bool(torch.isfinite(result.loss.detach()))
                stats = stats.merge(result.stats)
                if trainer.critic is not None:
                    critic_stats, critic_bad = _critic_backward(trainer, seqs, rows, exp, den, i == len(micro) - 1)
                    stats, nonfinite = stats.merge(critic_stats), nonfinite or critic_bad
            skipped += _optimizer_step(trainer, nonfinite, stats)
    return stats, skipped


def _critic_backward(trainer, seqs, rows, exp: Experience, den, last: bool) -> tuple[Stats, bool]:
    """Value-loss backward for one micro-batch; returns its stats and whether the loss was non-finite."""
    width = seqs.completion_width
    sync = contextlib.nullcontext() if last else trainer.strategy.no_sync(trainer.critic_wrapped)
    with sync:
        with trainer.autocast():
            values = trainer.critic_wrapped(seqs)
        result = value_loss(values.float(), _slice(exp.values, rows, width, trainer.device),
                            _slice(exp.returns, rows, width, trainer.device), _slice(exp.mask, rows, width, trainer.device),
                            trainer.cfg.algorithm.value_clip, num_tokens=den.num_tokens,
                            world_size=trainer.strategy.world_size)
        trainer.strategy.backward(result.loss * trainer.cfg.algorithm.value_coef, trainer.critic_wrapped)
    return result.stats, not bool(torch.isfinite(result.loss.detach()))


def _local_values(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter: its shard under FSDP2 (DTensor) or ZeRO-3 (`ds_tensor`), else itself."""
    shard = getattr(p, "ds_tensor", None)
    if shard is not None:
        return shard
    return p.to_local() if hasattr(p, "to_local") else p


def parameters_finite(params) -> bool:
    """Whether every value of these tensors (this rank's shards of them) is finite, with one device sync."""
    values = [_local_values(p).detach() for p in params]
    values = [v for v in values if v.numel()]
    return not values or bool(torch.stack([torch.isfinite(v).all() for v in values]).all())


def _stop_if_weights_diverged(trainer, params) -> None:
    """A finite gradient can still step the weights to inf/NaN (e.g. a huge learning rate): stop, never save them."""
    critic = list(trainer.critic.parameters()) if trainer.critic is not None else []
    bad = torch.tensor([float(not parameters_finite(params) or not parameters_finite(critic))])
    if trainer.strategy.all_reduce(bad, "max").item() > 0:
        raise UserError(f"step {trainer.step_count + 1}: the optimizer step made the weights non-finite (NaN/inf); "
                        f"nothing was saved from it. Lower train.lr (now {trainer.cfg.train.lr:g}) or "
                        "train.max_grad_norm and resume from the last checkpoint (train.resume=auto)")


def _optimizer_step(trainer, nonfinite: bool, stats: Stats) -> int:
    """Clip, agree across ranks, then step or skip (the strategy decides for all); returns 1 when skipped."""
    result = trainer.strategy.clip_and_step(trainer.trained_parts(), trainer.cfg.train.max_grad_norm, nonfinite)
    if result.skipped:
        trainer.message(f"step {trainer.step_count + 1}: non-finite loss or gradient on some rank; "
                        "this optimizer step is skipped on every rank (gradients dropped)")
    else:
        stats.add("actor/grad_norm", torch.tensor(result.grad_norms[0]))
        _stop_if_weights_diverged(trainer, [p for p in trainer.actor.parameters() if p.requires_grad])
    return int(result.skipped)

"""The policy (and critic) update: PPO epochs over mini-batches, gradient accumulation over micro-batches.

Loss denominators cover the whole mini-batch over all ranks, so accumulation is exact whatever
the micro-batch size (see `vlrft.algo.losses`). A non-finite loss or gradient on any rank skips
the optimizer step on every rank: the decision is all-reduced before anyone steps, and the
gradients are dropped, never applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlrft.algo import LossOutput, Stats, loss_denominators, policy_loss, value_loss, zero_advantage_rows_add_nothing
from vlrft.config import AlgorithmConfig
from vlrft.parallel.strategy import Strategy, TrainedModel
from vlrft.errors import DivergedError
from vlrft.trainer.experience import Batching, Experience, plan_micro_batches, sequences_for
from vlrft.trainer.out_of_memory import explain_out_of_memory


@dataclass(frozen=True)
class UpdateDeps:
    """What one step's update needs: the models it trains, the strategy that syncs them, the loss settings."""

    algo: AlgorithmConfig  # policy loss, value loss (clip, coefficient)
    strategy: Strategy  # no_sync, backward, all_reduce, clip_and_step over ranks
    batching: Batching
    policy: torch.nn.Module  # the actor as the strategy wrapped it (DDP/FSDP/DeepSpeed): forward and backward
    trained_parts: list[TrainedModel]  # what an optimizer step updates: the policy, then the critic
    watched_params: list[torch.nn.Parameter]  # checked for NaN/inf after each optimizer step
    ppo_epochs: int
    mini_batch_per_rank: int  # completions per optimizer step on this rank
    max_grad_norm: float
    max_new_tokens: int  # the token-sum loss normaliser (`loss_agg_mode` seq-mean-token-sum-norm)
    temperature: float  # logprobs are taken at the sampling temperature
    kl_coef: float  # the KL controller's current coefficient (KL in the loss)
    step: int  # the step being trained (1-based), for messages
    lr: float  # train.lr, named in the error when the weights diverge
    critic: torch.nn.Module | None = None  # the wrapped critic (PPO), else None
    message: Callable[[str], None] = print
    skip_zero_advantage_rows: bool = True  # train.skip_zero_advantage_rows (applies where the loss allows it)
    memory_fixes: tuple[str, ...] = ()  # options that lower the update's memory, named if the device runs out


def _full_engine_logprobs(exp, out, rows, width, device, on_policy: bool) -> torch.Tensor | None:
    """The engine's logprobs on the full distribution's scale, which TIS compares with the trainer's: the engines
    report the logprob of the top-k / top-p / min-p truncated distribution they sampled from, log p(a) - log(kept
    mass); adding the kept mass of the distribution the trainer's `old` logprobs come from (this forward's
    on-policy, the old-policy pass's otherwise) makes the weight 1 wherever engine and trainer agree."""
    engine = _slice(exp.engine_logprobs, rows, width, device)
    kept = (None if out.kept_log_mass is None else out.kept_log_mass.detach()) if on_policy \
        else _slice(exp.old_kept_log_mass, rows, width, device)
    if engine is None or kept is None:
        return engine
    return engine + kept


def _slice(t: torch.Tensor | None, rows: list[int], width: int, device) -> torch.Tensor | None:
    return None if t is None else t[rows, :width].to(device)


def update(deps: UpdateDeps, collected, exp: Experience) -> tuple[Stats, int]:
    """Run `ppo_epochs` passes; returns the loss statistics and how many optimizer steps were skipped."""
    strategy, batching, device = deps.strategy, deps.batching, deps.batching.device
    world = strategy.world_size
    n_rows = len(collected.rollouts)
    stats = Stats()
    skipped = 0
    skips_rows = skips_zero_advantage_rows(deps.skip_zero_advantage_rows, deps.algo, deps.kl_coef,
                                           has_critic=deps.critic is not None)
    for _epoch in range(deps.ppo_epochs):
        for start in range(0, n_rows, deps.mini_batch_per_rank):
            mini = list(range(start, min(start + deps.mini_batch_per_rank, n_rows)))
            den = loss_denominators(exp.mask[mini], reduce=lambda t: strategy.all_reduce(t, "sum"))
            all_rows = _all_ranks_rows(strategy, len(mini)) if deps.algo.router_aux_loss_coef > 0 else 1.0
            # non-finite losses, read once at the optimizer step: a read per micro-batch would make the host wait
            # for each backward before it prepares the next micro-batch
            nonfinite = torch.zeros((), dtype=torch.bool, device=device)
            if skips_rows:
                trained = rows_with_a_loss(exp, mini)
                stats.add("actor/zero_advantage_rows_skipped", float(len(mini) - len(trained)), float(len(mini)))
                micro = plan_micro_batches(batching, collected, trained, spare=mini)
            else:
                micro = plan_micro_batches(batching, collected, mini)
            for i, planned in enumerate(micro):
                rows = planned.rows
                # A filler only keeps this rank's forwards/backwards in step with the other ranks': weight 0.
                weight = 0.0 if planned.filler else 1.0
                seqs = sequences_for(batching, collected, rows)
                width = seqs.completion_width
                sync = contextlib.nullcontext() if i == len(micro) - 1 else strategy.no_sync(deps.policy)
                where = (f"step {deps.step}, training forward/backward of {len(rows)} completions "
                         f"({seqs.prompt_width} prompt + {width} completion positions per row)")
                with sync, explain_out_of_memory(where, deps.memory_fixes):
                    with batching.autocast():
                        out = deps.policy(seqs, deps.temperature)
                    mask = _slice(exp.mask, rows, width, device)
                    old = _slice(exp.old_logprobs, rows, width, device)
                    result = policy_loss(
                        deps.algo, out.logprobs, out.logprobs.detach() if old is None else old,
                        _slice(exp.advantages, rows, width, device), mask, entropy=out.entropy,
                        engine_logprobs=_full_engine_logprobs(exp, out, rows, width, device, on_policy=old is None),
                        ref_logprobs=_slice(exp.ref_logprobs, rows, width, device),
                        kl_coef=deps.kl_coef, num_tokens=den.num_tokens, num_seqs=den.num_seqs,
                        max_tokens=deps.max_new_tokens, world_size=world)
                    result = _with_router_loss(result, out, deps.algo.router_aux_loss_coef, len(rows), all_rows, world)
                    strategy.backward(result.loss if weight == 1.0 else result.loss * weight, deps.policy)
                if planned.filler:  # counts nothing, but keeps the metric names every rank reduces
                    stats = stats.merge(result.stats.emptied())
                else:
                    nonfinite |= ~torch.isfinite(result.loss.detach()).to(device)
                    stats = stats.merge(result.stats)
                if deps.critic is not None:
                    critic_stats, critic_bad = _critic_backward(deps, seqs, rows, exp, den, i == len(micro) - 1,
                                                                weight)
                    if not planned.filler:
                        stats, nonfinite = stats.merge(critic_stats), nonfinite | critic_bad
            with explain_out_of_memory(f"step {deps.step}, optimizer step", deps.memory_fixes):
                skipped += _optimizer_step(deps, bool(nonfinite), stats)
    return stats, skipped


def _all_ranks_rows(strategy: Strategy, rows: int) -> float:
    """The mini-batch's rows on all ranks (what the router loss of each micro-batch is weighted against)."""
    return float(strategy.all_reduce(torch.tensor([float(rows)], dtype=torch.float64), "sum").item())


def _with_router_loss(result: LossOutput, out, coef: float, rows: int, all_rows: float, world: int) -> LossOutput:
    """The policy loss plus `coef` times the micro-batch's MoE router load-balancing loss (`out.router_aux_loss`),
    weighted by its share of the mini-batch's rows on all ranks, times `world` as the policy loss (the ranks'
    gradients are averaged): a row-weighted mean over micro-batches, as gradient accumulation in transformers'
    Trainer takes one. Logged as actor/router_aux_loss (its mean over rows)."""
    if out.router_aux_loss is None or coef == 0:
        return result
    aux = out.router_aux_loss.float()
    result.stats.add("actor/router_aux_loss", aux.detach() * rows, float(rows))
    return dataclasses.replace(result, loss=result.loss + coef * aux * (rows * world / all_rows))


def skips_zero_advantage_rows(enabled: bool, algo: AlgorithmConfig, kl_coef: float, has_critic: bool) -> bool:
    """Whether the update leaves zero-advantage rows out (`train.skip_zero_advantage_rows`): where their policy
    loss is exactly 0 and no critic trains on them. Ranks then train different numbers of rows."""
    return enabled and not has_critic and zero_advantage_rows_add_nothing(algo, kl_coef)


def rows_with_a_loss(exp: Experience, rows: list[int]) -> list[int]:
    """The rows among `rows` with a non-zero advantage at some token that trains (the others' loss is 0)."""
    live = ((exp.advantages[rows] != 0) & exp.mask[rows].bool()).any(dim=1)
    return [row for row, keep in zip(rows, live.tolist()) if keep]


def _critic_backward(deps: UpdateDeps, seqs, rows, exp: Experience, den, last: bool,
                     weight: float = 1.0) -> tuple[Stats, torch.Tensor]:
    """Value-loss backward for one micro-batch (`weight` 0: a filler); returns its stats and whether the loss was
    non-finite (a boolean tensor on the device, not read here)."""
    width, device, strategy = seqs.completion_width, deps.batching.device, deps.strategy
    sync = contextlib.nullcontext() if last else strategy.no_sync(deps.critic)
    with sync:
        with deps.batching.autocast():
            values = deps.critic(seqs)
        result = value_loss(values.float(), _slice(exp.values, rows, width, device),
                            _slice(exp.returns, rows, width, device), _slice(exp.mask, rows, width, device),
                            deps.algo.value_clip, num_tokens=den.num_tokens, world_size=strategy.world_size)
        strategy.backward(result.loss * (deps.algo.value_coef * weight), deps.critic)
    return result.stats, ~torch.isfinite(result.loss.detach()).to(deps.batching.device)


def _local_values(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter: its shard under FSDP2 (DTensor) or ZeRO-3 (`ds_tensor`), else itself.

    A ZeRO-3 shard is padded so every rank's shard has the same size; the padding (past the parameter's
    `ds_numel` elements, all on the last ranks) is never initialized by DeepSpeed and holds whatever the
    memory held, NaN bits included (e.g. rank 1's whole shard of a critic's 1-element value-head bias). Only
    the real elements are returned, else the diverged-weights check would stop a healthy run at random.
    """
    shard = getattr(p, "ds_tensor", None)
    if shard is not None:
        shard = shard.view(-1)
        rank = dist.get_rank(group=p.ds_process_group) if dist.is_initialized() else 0
        real = min(max(p.ds_numel - rank * shard.numel(), 0), shard.numel())
        return shard[:real]
    return p.to_local() if hasattr(p, "to_local") else p


def parameters_finite(params) -> bool:
    """Whether every value of these tensors (this rank's shards of them) is finite, with one device sync.

    One pass over the weights: each tensor's L2 norm, all tensors in one foreach call (as
    `clip_grad_norm_` takes the gradients' norms); NaN and inf propagate into it. On CPU the L2
    norm is vectorised and the inf-norm is not (5M float32 values: 0.7 ms vs 13 ms). Only where an
    L2 norm is not finite is the inf-norm taken, since squares of huge finite values (|x| > 1.8e19
    in float32) overflow too.
    """
    values = [_local_values(p).detach() for p in params]
    values = [v for v in values if v.numel()]
    if not values:
        return True
    if _all_finite(torch._foreach_norm(values, 2.0)):
        return True
    return _all_finite(torch._foreach_norm(values, float("inf")))


def _all_finite(norms: list[torch.Tensor]) -> bool:
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


# One optimizer step may change the norm of the trained weights by at most this fraction of it. Adam moves each
# weight by about lr per step, so a step changes the norm by about lr / (the weights' typical size): 1e-6 / 0.02 =
# 5e-5 for a usual fine-tuning rate, 0.05 for the tests' lr=1e-3 on tiny models. A step past half the norm is not
# learning but divergence (train.lr=1e30 moved the weights to 1e30 in one step, all finite, and the next step's
# logits were NaN); it is stopped before it is saved, so the last checkpoint stays the one to resume from.
MAX_NORM_CHANGE = 0.5


def weights_norm_sq(params) -> torch.Tensor:
    """Sum of squares of this rank's values of `params` (its shards), in float64 on their device; not read here.

    Non-finite where a value is non-finite or the float32 norm of a tensor overflows (|x| > ~1e19): both are
    divergence."""
    values = [_local_values(p).detach() for p in params]
    values = [v for v in values if v.numel()]
    if not values:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(values, 2.0)
    return torch.stack([n.double().to(norms[0].device) for n in norms]).pow(2).sum()


def _stop_if_weights_diverged(deps: UpdateDeps, before_sq: torch.Tensor) -> None:
    """A finite gradient can still step the weights to inf/NaN, or to finite but absurd values (e.g. a huge learning
    rate): stop, never save them. `before_sq`: `weights_norm_sq` of the weights before the step."""
    bad = torch.tensor([float(not parameters_finite(deps.watched_params))])
    if deps.strategy.all_reduce(bad, "max").item() > 0:
        raise DivergedError(f"step {deps.step}: the optimizer step made the weights non-finite (NaN/inf); "
                            f"nothing was saved from it. Lower train.lr (now {deps.lr:g}) or "
                            "train.max_grad_norm and resume from the last checkpoint (train.resume=auto)")
    after_sq = weights_norm_sq(deps.watched_params)
    sums = deps.strategy.all_reduce(torch.stack([before_sq.cpu(), after_sq.cpu()]), "sum").tolist()
    before, after = (math.sqrt(v) if math.isfinite(v) else math.inf for v in sums)
    if before > 0 and (not math.isfinite(after) or abs(after - before) > MAX_NORM_CHANGE * before):
        shown = f"{after:.4g} ({after / before:.3g} times" if math.isfinite(after) else \
            "a norm float32 cannot hold (weights past ~1e19"
        raise DivergedError(f"step {deps.step}: the optimizer step changed the norm of the trained weights from "
                            f"{before:.4g} to {shown}; at most {1 + MAX_NORM_CHANGE:g} times is allowed in one step): "
                            "training diverged, and nothing was saved from this step. Lower train.lr "
                            f"(now {deps.lr:g}) or train.max_grad_norm and resume from the last checkpoint "
                            "(train.resume=auto)")


def _optimizer_step(deps: UpdateDeps, nonfinite: bool, stats: Stats) -> int:
    """Clip, agree across ranks, then step or skip (the strategy decides for all); returns 1 when skipped."""
    before_sq = weights_norm_sq(deps.watched_params)  # not read until after the step: no extra wait
    result = deps.strategy.clip_and_step(deps.trained_parts, deps.max_grad_norm, nonfinite)
    if result.skipped:
        deps.message(f"step {deps.step}: non-finite loss or gradient on some rank; "
                     "this optimizer step is skipped on every rank (gradients dropped)")
    else:
        stats.add("actor/grad_norm", torch.tensor(result.grad_norms[0]))
        _stop_if_weights_diverged(deps, before_sq)
    return int(result.skipped)

"""Advantage estimators behind one registry: GRPO, Dr. GRPO, RLOO, REINFORCE++(-baseline), GAE, CPGD.

Inputs are the scalar reward per completion ([N], NaN = "not applicable"), the completion-token
mask [N, T] and the group size G (rows [g*G, (g+1)*G) are the completions of prompt g).
Advantages are computed once per rollout batch, here, and never re-normalised later (not per
micro-batch, not in a buffer, not in the loss; docs/design.md, "Traps").

Multi-rank: the trainer places whole groups on each rank, so group statistics are local. Batch
statistics (`scale_rewards: batch`, REINFORCE++ and GAE whitening, CPGD's clip-filter weight) go
through `reduce`, a sum-all-reduce over ranks, as sums, sums of squares and counts, so they are
exact over the global batch. Every rank makes the same `reduce` calls in the same order.

Register your own estimator:

    @register_advantage("my_adv")
    def my_adv(inp: AdvantageInput) -> EstimatorOutput:
        scores = sequence_scores(inp)                       # [N], NaN where not applicable
        return EstimatorOutput(advantages=broadcast_to_tokens(scores, inp.mask))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from vlrft.algo.groups import group_moments, zero_variance_groups
from vlrft.algo.stats import Stats
from vlrft.config import AlgorithmConfig
from vlrft.registry import ADVANTAGES

Reducer = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class AdvantageInput:
    """Everything an estimator may use; built by `compute_advantages`."""

    cfg: AlgorithmConfig
    rewards: Tensor  # [N] float, NaN = not applicable
    mask: Tensor  # [N, T] bool, completion tokens
    group_size: int
    values: Tensor | None = None  # [N, T] critic values (GAE)
    token_rewards: Tensor | None = None  # [N, T] per-token additions, e.g. -beta * KL with kl_in=reward
    reduce: Reducer | None = None  # sum-all-reduce over ranks; None = this process holds the whole batch


@dataclass(frozen=True)
class EstimatorOutput:
    """What an estimator returns; `compute_advantages` zeroes padding and not-applicable rows afterwards."""

    advantages: Tensor  # [N, T]
    returns: Tensor | None = None  # [N, T], value targets for the critic (GAE) or the raw returns


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages ready for the loss; zero on padding and on rows whose reward was not applicable."""

    advantages: Tensor  # [N, T] float32
    returns: Tensor | None  # [N, T] float32 or None
    valid: Tensor  # [N] bool: the row's reward was applicable (use `mask & valid[:, None]` to drop the rest)
    stats: Stats


AdvantageEstimator = Callable[[AdvantageInput], EstimatorOutput]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = ADVANTAGES.entries


def register_advantage(name: str, *, override: bool = False) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding an estimator under `name` (then usable as `algorithm.advantage: name`).

    A different function under a taken name is an error unless `override=True` (vlrft.registry's rule).
    """
    return ADVANTAGES.register(name, override=override)


def compute_advantages(cfg: AlgorithmConfig, rewards: Tensor, mask: Tensor, group_size: int,
                       values: Tensor | None = None, token_rewards: Tensor | None = None,
                       reduce: Reducer | None = None) -> AdvantageResult:
    """Run the estimator named by `cfg.advantage`; never returns NaN, whatever the rewards."""
    estimator = ADVANTAGES.resolve(cfg.advantage)  # a registered name, module:function or path.py:function
    if rewards.ndim != 1 or mask.ndim != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must be [N] and [N, T]")
    if torch.isinf(rewards).any():  # NaN means "not applicable"; an infinite reward is a bug upstream
        raise ValueError(f"rewards contain +-inf at rows {torch.isinf(rewards).nonzero().flatten().tolist()}; "
                         "a reward must be a finite number or NaN (not applicable)")
    for name, t in (("values", values), ("token_rewards", token_rewards)):
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected the mask's shape {tuple(mask.shape)}")
    inp = AdvantageInput(cfg=cfg, rewards=rewards.detach().float(), mask=mask.bool(), group_size=group_size,
                         values=None if values is None else values.detach().float(),
                         token_rewards=None if token_rewards is None else token_rewards.detach().float(),
                         reduce=reduce)
    out = estimator(inp)
    valid = ~torch.isnan(sequence_scores(inp))
    keep = inp.mask & valid[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    advantages = torch.where(keep, out.advantages.float(), zero)
    returns = None if out.returns is None else torch.where(keep, out.returns.float(), zero)
    return AdvantageResult(advantages=advantages, returns=returns, valid=valid,
                           stats=_advantage_stats(inp, advantages, returns, valid, keep))


# ----------------------------------------------------------------------------------------------
# building blocks (public so custom estimators can reuse them)


def sequence_scores(inp: AdvantageInput) -> Tensor:
    """Scalar score per completion: the reward plus the sum of its token rewards (if any); NaN stays NaN.

    This is how outcome-level estimators (GRPO family, RLOO, CPGD) see `token_rewards`: folded into
    the sequence score before group statistics, as verl does with KL-in-reward.
    """
    if inp.token_rewards is None:
        return inp.rewards
    return inp.rewards + (inp.token_rewards * inp.mask).sum(dim=1)


def broadcast_to_tokens(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """[N] -> [N, T]: every completion token gets its sequence's value; padding gets 0; NaN becomes 0."""
    per_sequence = torch.nan_to_num(per_sequence, nan=0.0)
    return per_sequence[:, None] * mask.to(per_sequence.dtype)


def token_level_rewards(inp: AdvantageInput, scalar: Tensor) -> Tensor:
    """[N, T] rewards: `token_rewards` on completion tokens plus `scalar` (NaN -> 0) on each row's last valid token."""
    mask = inp.mask
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if inp.token_rewards is not None:
        out = inp.token_rewards * mask
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)  # -1: no valid token
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)
    bonus = torch.where(has_tokens, torch.nan_to_num(scalar, nan=0.0), torch.zeros_like(scalar))
    # index_put with accumulate builds a new tensor; the caller's token_rewards stay untouched
    return out.index_put((rows, last.clamp(min=0)), bonus, accumulate=True)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over completion tokens (padding is skipped, not discounted)."""
    r = token_rewards * mask
    if gamma == 1.0:  # reverse cumulative sum, no Python loop
        return r.flip(1).cumsum(1).flip(1) * mask
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    out = []
    for t in reversed(range(r.shape[1])):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        out.append(running)
    return torch.stack(out[::-1], dim=1) * mask


def global_moments(x: Tensor, where: Tensor, reduce: Reducer | None) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, population variance) of `x[where]` over all ranks, from one reduced [count, sum, sumsq]."""
    x64 = torch.where(where, x.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    packed = torch.stack([where.sum().to(torch.float64), x64.sum(), x64.square().sum()])
    if reduce is not None:
        packed = reduce(packed)
    n, s, ss = packed[0], packed[1], packed[2]
    mean = s / n.clamp(min=1)
    var = (ss / n.clamp(min=1) - mean.square()).clamp(min=0)  # clamp: float rounding can dip below 0
    return n, mean, var


def masked_whiten(x: Tensor, where: Tensor, eps: float, reduce: Reducer | None) -> Tensor:
    """(x - mean) / (std + eps) with mean and population std over `where` on all ranks; 0 outside `where`."""
    _, mean, var = global_moments(x, where, reduce)
    out = ((x.to(torch.float64) - mean) / (var.sqrt() + eps)).to(x.dtype)
    return torch.where(where, out, torch.zeros_like(out))


def _applicable_tokens(inp: AdvantageInput) -> Tensor:
    return inp.mask & ~torch.isnan(sequence_scores(inp))[:, None]


# ----------------------------------------------------------------------------------------------
# the estimators


@register_advantage("grpo")
def grpo(inp: AdvantageInput) -> EstimatorOutput:
    """GRPO (arXiv:2402.03300): A_i = (r_i - mean_group(r)) / (std + eps), std chosen by `scale_rewards`.

    "group": the group's unbiased std (GRPO); "batch": the unbiased std of all valid rewards in the
    global batch (group mean, batch std, as TRL's scale_rewards="batch"); "none": no division (Dr. GRPO).
    """
    cfg = inp.cfg
    scores = sequence_scores(inp)
    m = group_moments(scores, inp.group_size)
    centred = (m.rewards - m.mean[:, None]).flatten()
    if cfg.scale_rewards == "group":
        centred = centred / (m.std.repeat_interleave(inp.group_size) + cfg.adv_eps)
    elif cfg.scale_rewards == "batch":
        valid = ~torch.isnan(scores)
        n, _, var = global_moments(scores, valid, inp.reduce)
        std = (var * n / (n - 1).clamp(min=1)).sqrt()  # population -> unbiased, like torch.std
        centred = centred / (std + cfg.adv_eps)
    return EstimatorOutput(advantages=broadcast_to_tokens(centred, inp.mask))


@register_advantage("drgrpo")
def drgrpo(inp: AdvantageInput) -> EstimatorOutput:
    """Dr. GRPO (arXiv:2503.20783): A_i = r_i - mean_group(r), no std division whatever `scale_rewards` says."""
    scores = sequence_scores(inp)
    m = group_moments(scores, inp.group_size)
    return EstimatorOutput(advantages=broadcast_to_tokens((m.rewards - m.mean[:, None]).flatten(), inp.mask))


@register_advantage("rloo")
def rloo(inp: AdvantageInput) -> EstimatorOutput:
    """RLOO (arXiv:2402.14740): A_i = r_i - mean of the OTHER valid rewards in the group.

    Not-applicable siblings are not part of the baseline; a row with no valid sibling gets 0.
    """
    m = group_moments(sequence_scores(inp), inp.group_size)
    others = (m.count[:, None] - 1).clamp(min=1)
    baseline = (m.total[:, None] - m.rewards) / others
    adv = torch.where(m.count[:, None] >= 2, m.rewards - baseline, torch.zeros_like(m.rewards))
    return EstimatorOutput(advantages=broadcast_to_tokens(adv.flatten(), inp.mask))


def _reinforce_pp(inp: AdvantageInput, scalar: Tensor) -> EstimatorOutput:
    """Token returns from `scalar` (last token) + `token_rewards`, whitened over all valid tokens of all ranks."""
    returns = discounted_returns(token_level_rewards(inp, scalar), inp.mask, inp.cfg.gamma)
    where = _applicable_tokens(inp)
    return EstimatorOutput(advantages=masked_whiten(returns, where, inp.cfg.adv_eps, inp.reduce), returns=returns)


@register_advantage("reinforce_pp")
def reinforce_pp(inp: AdvantageInput) -> EstimatorOutput:
    """REINFORCE++ (arXiv:2501.03262): discounted token returns, whitened over the global batch of tokens."""
    return _reinforce_pp(inp, inp.rewards)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(inp: AdvantageInput) -> EstimatorOutput:
    """REINFORCE++-baseline: subtract the group mean of the scalar rewards, then as REINFORCE++ (global whitening)."""
    m = group_moments(inp.rewards, inp.group_size)
    centred = (m.rewards - m.mean[:, None]).flatten()
    return _reinforce_pp(inp, torch.where(torch.isnan(inp.rewards), inp.rewards, centred))


@register_advantage("gae")
def gae(inp: AdvantageInput) -> EstimatorOutput:
    """GAE (arXiv:1506.02438) with a critic: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}.

    The scalar reward lands on the last completion token, which is terminal (V after it is 0);
    padding between tokens is skipped. returns = A + V (the critic's targets, before whitening);
    with `gae_whiten` the advantages are then whitened once over the global batch.
    """
    if inp.values is None:
        raise ValueError("algorithm.advantage=gae needs the critic's values ([N, T]) passed as `values`")
    cfg, mask, values = inp.cfg, inp.mask, inp.values
    rewards = token_level_rewards(inp, inp.rewards)
    next_value = torch.zeros(mask.shape[0], dtype=values.dtype, device=values.device)
    running = torch.zeros_like(next_value)
    out = []
    for t in reversed(range(mask.shape[1])):
        valid = mask[:, t]
        delta = rewards[:, t] + cfg.gamma * next_value - values[:, t]
        running = torch.where(valid, delta + cfg.gamma * cfg.lam * running, running)
        next_value = torch.where(valid, values[:, t], next_value)
        out.append(running)
    advantages = torch.stack(out[::-1], dim=1) * mask
    returns = (advantages + values) * mask
    if cfg.gae_whiten:
        advantages = masked_whiten(advantages, _applicable_tokens(inp), cfg.adv_eps, inp.reduce)
    return EstimatorOutput(advantages=advantages, returns=returns)


@register_advantage("cpgd")
def cpgd(inp: AdvantageInput) -> EstimatorOutput:
    """CPGD's weighted advantage (Liu et al. 2025, "CPGD: Toward Stable Rule-based RL for LMs", arXiv:2505.12504).

    A_i = w * (r_i - mean_group(r)) with `cpgd_weight`: "std" w = 1 / (group std + eps);
    "clip_filter" w = min(num_groups / num_groups_with_nonzero_variance, cpgd_weight_cap) over the
    global batch (what filtering out zero-variance groups would do to the loss scale, without
    discarding them); "none" w = 1.
    """
    cfg = inp.cfg
    scores = sequence_scores(inp)
    m = group_moments(scores, inp.group_size)
    centred = m.rewards - m.mean[:, None]
    if cfg.cpgd_weight == "std":
        centred = centred / (m.std[:, None] + cfg.adv_eps)
    elif cfg.cpgd_weight == "clip_filter":
        informative = (~zero_variance_groups(scores, inp.group_size)).sum()
        counts = torch.stack([torch.tensor(float(m.count.shape[0]), device=scores.device), informative.float()])
        if inp.reduce is not None:
            counts = inp.reduce(counts)
        weight = (counts[0] / counts[1].clamp(min=1)).clamp(max=cfg.cpgd_weight_cap)
        centred = centred * weight
    return EstimatorOutput(advantages=broadcast_to_tokens(centred.flatten(), inp.mask))


# ----------------------------------------------------------------------------------------------


def _advantage_stats(inp: AdvantageInput, advantages: Tensor, returns: Tensor | None, valid: Tensor,
                     keep: Tensor) -> Stats:
    """Per-rank sums and counts; reduce them with `Stats.reduce` before logging."""
    stats = Stats()
    scores = torch.nan_to_num(sequence_scores(inp), nan=0.0)
    stats.add("rewards/mean", (scores * valid).sum(), valid.sum())
    stats.add("rewards/not_applicable_frac", (~valid).sum(), valid.numel())
    zero_var = zero_variance_groups(sequence_scores(inp), inp.group_size)
    stats.add("rewards/zero_variance_group_frac", zero_var.sum(), zero_var.numel())
    stats.add_masked("advantages/mean", advantages, keep)
    stats.add_max("advantages/abs_max", advantages.abs(), keep)
    if returns is not None:
        stats.add_masked("returns/mean", returns, keep)
    return stats

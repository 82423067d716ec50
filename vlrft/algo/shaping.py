"""Reward shaping applied to scalar rewards before advantages: overlong penalty, clipping, running normalisation.

All functions keep NaN ("not applicable") rewards NaN and never modify their inputs.
Dynamic sampling's filter, `zero_variance_groups`, lives in `vlrft.algo.groups` and is re-exported here.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from vlrft.algo.groups import zero_variance_groups

__all__ = ["overlong_penalty", "clip_rewards", "RunningMoments", "zero_variance_groups", "expand_groups"]


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), one value per completion, to add to the reward.

    With L_exp = max_new_tokens - buffer: 0 for length <= L_exp, a linear ramp
    (L_exp - length) / buffer * penalty inside the buffer, and -penalty beyond max_new_tokens.
    `buffer` 0 turns it off (all zeros).
    """
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    expected = float(max_new_tokens - buffer)
    ramp = (expected - lengths) / buffer * penalty
    out = torch.where(lengths <= expected, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_new_tokens, torch.full_like(lengths, -penalty), out)


def clip_rewards(rewards: Tensor, clip: float | None) -> Tensor:
    """Rewards clamped to [-clip, clip] (a copy; `clip` None returns them unchanged). NaN stays NaN."""
    if clip is None:
        return rewards.clone()
    return rewards.clamp(-clip, clip)


def expand_groups(group_flags: Tensor, group_size: int) -> Tensor:
    """Per-group flags [num_groups] -> per-row flags [num_groups * group_size] (rows of a group are contiguous)."""
    return group_flags.repeat_interleave(group_size)


class RunningMoments:
    """Running mean and std of every valid reward seen, for `algorithm.normalize_rewards`.

    `update` merges a batch's count, sum and sum of squared deviations (Chan et al.'s parallel
    formula, in float64); with `reduce` (a sum-all-reduce) the batch statistics cover all ranks
    exactly, so every rank holds the same moments. The state is checkpointed with the run
    (`state_dict` / `load_state_dict`) so a resumed run normalises the same way.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        """Unbiased std of everything seen; 1.0 until two values have been seen (no scaling yet)."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def update(self, rewards: Tensor, reduce: Callable[[Tensor], Tensor] | None = None) -> None:
        """Fold this batch's non-NaN rewards into the running moments (all ranks when `reduce` is given)."""
        r = rewards.detach().to(torch.float64).flatten()
        valid = ~torch.isnan(r)
        r = torch.where(valid, r, torch.zeros_like(r))
        n, s = valid.sum().to(torch.float64), r.sum()
        packed = torch.stack([n, s])
        if reduce is not None:
            packed = reduce(packed)
        n, s = packed.tolist()
        if n == 0:
            return
        batch_mean = s / n
        # the deviations need the global batch mean, hence a second (tiny) reduction
        dev = torch.where(valid, r - batch_mean, torch.zeros_like(r)).square().sum().reshape(1)
        if reduce is not None:
            dev = reduce(dev)
        batch_m2 = float(dev.item())
        total = self.count + n
        delta = batch_mean - self.mean
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    def normalize(self, rewards: Tensor) -> Tensor:
        """(rewards - mean) / (std + eps) as a new tensor; NaN stays NaN."""
        return (rewards - self.mean) / (self.std + self.eps)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])

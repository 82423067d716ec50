"""Types that cross the reward API boundary: the error, per-function statistics and the scored result.

Statistics are kept as sums and counts (`RewardStats`) so a multi-rank trainer can all-reduce them
exactly and only then turn them into means and standard deviations (`reward_metrics`).
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field, fields
from typing import TYPE_CHECKING

from vlrft.errors import UserError

if TYPE_CHECKING:  # torch is imported lazily so grading worker processes stay light
    import torch

TOTAL_KEY = "total"  # key of the combined reward in `RewardResult.stats` and the metrics


class RewardError(UserError):
    """A reward function failed, timed out or returned something unusable; the message names the
    function, the sample indices and the fix."""


class RewardSampleError(ValueError):
    """Raised by a reward function about one input: `index` is the position in the lists it was given.

    `RewardSet` reports it with the batch's sample index, e.g. "reward function 'choice' failed on sample 5".
    """

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


@dataclass
class RewardStats:
    """Sums and counts of one reward over the samples routed to it; add them across ranks, then
    call `reward_metrics`."""

    count: float = 0.0  # samples that got a value
    total: float = 0.0  # sum of the values
    total_sq: float = 0.0  # sum of squared values
    not_applicable: float = 0.0  # routed samples without a value (None, or an error under on_error=none)
    errors: float = 0.0  # routed samples whose value was lost to an error (a subset of not_applicable)

    def __add__(self, other: RewardStats) -> RewardStats:
        return RewardStats(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def to_list(self) -> list[float]:
        return list(astuple(self))

    @classmethod
    def from_list(cls, values: list[float]) -> RewardStats:
        if len(values) != len(fields(cls)):
            raise ValueError(f"RewardStats.from_list needs {len(fields(cls))} numbers, got {len(values)}")
        return cls(*(float(v) for v in values))

    @classmethod
    def of(cls, values: list[float], errors: int = 0) -> RewardStats:
        """Statistics of the values of the routed samples; NaN entries count as not applicable."""
        present = [v for v in values if not math.isnan(v)]
        return cls(
            count=float(len(present)),
            total=float(sum(present)),
            total_sq=float(sum(v * v for v in present)),
            not_applicable=float(len(values) - len(present)),
            errors=float(errors),
        )


def reward_metrics(stats: dict[str, RewardStats]) -> dict[str, float]:
    """`reward/<key>/mean|std|frac_none|errors` from (possibly rank-summed) statistics.

    std is the population standard deviation over the samples with a value; mean and std are left out
    for a reward that got no value at all, frac_none for one that was routed to no sample.
    """
    out: dict[str, float] = {}
    for key, s in stats.items():
        routed = s.count + s.not_applicable
        if s.count > 0:
            mean = s.total / s.count
            out[f"reward/{key}/mean"] = mean
            out[f"reward/{key}/std"] = math.sqrt(max(s.total_sq / s.count - mean * mean, 0.0))
        if routed > 0:
            out[f"reward/{key}/frac_none"] = s.not_applicable / routed
        out[f"reward/{key}/errors"] = s.errors
    return out


def stats_to_tensor(stats: dict[str, RewardStats]) -> tuple[list[str], torch.Tensor]:
    """Keys (sorted) and a float64 [num_keys, 5] tensor of the statistics, ready for `all_reduce(SUM)`."""
    import torch

    keys = sorted(stats)
    return keys, torch.tensor([stats[k].to_list() for k in keys], dtype=torch.float64).reshape(len(keys), -1)


def stats_from_tensor(keys: list[str], tensor: torch.Tensor) -> dict[str, RewardStats]:
    """Inverse of `stats_to_tensor` (after the reduction)."""
    rows = tensor.detach().cpu().double().tolist()
    return {k: RewardStats.from_list(row) for k, row in zip(keys, rows)}


@dataclass
class RewardResult:
    """Rewards of one batch of completions.

    `total[i]` is the weighted sum of the rewards that applied to sample i (NaN when none applied);
    `per_function[key][i]` is NaN where that function returned None, failed under on_error=none, or
    was not routed to sample i by its label.
    """

    total: torch.Tensor  # [N] float32
    per_function: dict[str, torch.Tensor]  # key -> [N] float32
    stats: dict[str, RewardStats]  # every function key of the RewardSet plus "total"; sums for exact reduction
    metrics: dict[str, float]  # this batch's metrics (this rank only); reduce `stats` for global ones
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per function call
    error_messages: list[str] = field(default_factory=list)  # errors counted as "not applicable"

    @property
    def applicable(self) -> torch.Tensor:
        """[N] bool: samples for which at least one reward function gave a value."""
        return ~self.total.isnan()

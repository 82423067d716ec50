"""Per-group reward statistics that ignore "not applicable" rewards (NaN).

Completions of one prompt are contiguous: rows [g*G, (g+1)*G) form group g. A NaN reward means
"not applicable": that row takes no part in its siblings' mean, std or leave-one-out baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupMoments:
    """Statistics of each group's valid rewards; tensors are [num_groups] unless noted."""

    rewards: Tensor  # [num_groups, G], NaN replaced by 0
    valid: Tensor  # [num_groups, G] bool, reward is not NaN
    count: Tensor  # valid rewards per group
    total: Tensor  # sum of valid rewards
    mean: Tensor  # 0 for a group with no valid reward
    std: Tensor  # unbiased (n - 1) std; 0 when fewer than two valid rewards


def group_moments(rewards: Tensor, group_size: int) -> GroupMoments:
    """Mean and unbiased std per group over non-NaN rewards, with no NaN in the output."""
    if group_size < 1 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}; "
                         "expected a 1-D tensor whose length is a multiple of the group size")
    r = rewards.detach().to(torch.float32 if not rewards.is_floating_point() else rewards.dtype).view(-1, group_size)
    valid = ~torch.isnan(r)
    r = torch.where(valid, r, torch.zeros_like(r))
    count = valid.sum(dim=1).to(r.dtype)
    total = r.sum(dim=1)
    mean = total / count.clamp(min=1)
    dev = torch.where(valid, r - mean[:, None], torch.zeros_like(r))
    # unbiased like torch.std (what TRL and verl use); a single valid reward has zero deviation,
    # so dividing by max(n - 1, 1) gives std 0 instead of NaN
    std = (dev.square().sum(dim=1) / (count - 1).clamp(min=1)).sqrt()
    return GroupMoments(rewards=r, valid=valid, count=count, total=total, mean=mean, std=std)


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Bool [num_groups]: True where a group carries no learning signal for group-relative methods.

    That is every group whose valid rewards are all equal, including groups with fewer than two
    valid rewards (all "not applicable", or a single one). Dynamic sampling drops these groups and
    the trainer refills the batch with new prompts, so nothing is ever normalised by a zero std.
    """
    m = group_moments(rewards, group_size)
    spread = torch.where(m.valid, m.rewards, torch.full_like(m.rewards, float("-inf"))).amax(dim=1) - \
        torch.where(m.valid, m.rewards, torch.full_like(m.rewards, float("inf"))).amin(dim=1)
    return (m.count < 2) | (spread == 0)

"""Reward API: user reward functions, built-in rule rewards, reward models and remote rewards.

A reward function takes the completions (list[str]) plus keyword arguments and returns one float per
completion, or None for "not applicable"; see docs/rewards.md. `RewardSet` runs the configured ones.
"""

from vlrft.rewards.registry import registered_rewards, resolve_reward, reward
from vlrft.rewards.reward_set import REWARD_ARGUMENTS, RewardSet
from vlrft.rewards.types import (
    RewardError,
    RewardResult,
    RewardSampleError,
    RewardStats,
    reward_metrics,
    stats_from_tensor,
    stats_to_tensor,
)

# Importing these registers the built-in rewards.
from vlrft.rewards import builtin, remote, reward_model  # noqa: E402,F401  isort: skip

__all__ = [
    "REWARD_ARGUMENTS",
    "RewardError",
    "RewardResult",
    "RewardSampleError",
    "RewardSet",
    "RewardStats",
    "registered_rewards",
    "resolve_reward",
    "reward",
    "reward_metrics",
    "stats_from_tensor",
    "stats_to_tensor",
]

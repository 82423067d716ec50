"""Held-out evaluation: accuracy (greedy or sampled), pass@k and mean reward, reduced over ranks.

A completion is correct when the accuracy reward (`train.eval_accuracy_reward`, default the first
configured reward function) gives it more than 0.5; with `train.eval_n = k > 1` samples per prompt,
pass@k is the share of prompts with at least one correct sample. Every rank evaluates its own
slice of the eval set; sums and counts are reduced so the numbers are exact over all of it. Every
rank calls `generate` equally often (a rank with a shorter slice, or whose batch was all skipped,
generates on an empty batch): ranks sharing a tensor-parallel engine must run it in lockstep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vlrft.algo import Stats
from vlrft.data import PromptEncoder
from vlrft.errors import UserError
from vlrft.rollout.base import RolloutEngine, SamplingParams
from vlrft.trainer.collect import score_on_every_rank
from vlrft.trainer.experience import Reduce

if TYPE_CHECKING:
    from vlrft.rewards import RewardSet


@dataclass(frozen=True)
class EvalDeps:
    """What `evaluate` needs: the held-out samples, how to answer them, and what counts as correct."""

    samples: list  # the whole eval set; this rank evaluates samples[rank::world_size]
    rank: int
    world_size: int
    encoder: PromptEncoder
    engine: RolloutEngine
    sampling: SamplingParams  # eval_n samples per prompt at eval_temperature
    batch_prompts: int  # prompts per generate call (train.eval_batch_prompts)
    rewards: RewardSet
    accuracy_key: str  # the reward whose value > 0.5 marks a completion correct
    reduce: Reduce  # sum over ranks
    gather_objects: Callable[[Any], list] = lambda obj: [obj]  # every rank's object (strategy.all_gather_object)


def accuracy_reward_key(cfg, reward_set) -> str:
    """The reward key that decides correctness: `train.eval_accuracy_reward` or the first configured function."""
    keys = list(reward_set.keys)
    if cfg.train.eval_accuracy_reward:
        if cfg.train.eval_accuracy_reward not in keys:
            raise UserError(f"config: train.eval_accuracy_reward={cfg.train.eval_accuracy_reward!r} is not a configured "
                            f"reward; expected one of {', '.join(keys)}")
        return cfg.train.eval_accuracy_reward
    return keys[0] if keys else ""


def evaluate(deps: EvalDeps, step: int) -> dict[str, float]:
    """Accuracy, pass@k, mean reward and length over the eval set, exact over all ranks."""
    samples = deps.samples[deps.rank::deps.world_size]
    largest_share = -(-len(deps.samples) // deps.world_size)  # rank 0's slice; the others are at most one shorter
    sampling, key = deps.sampling, deps.accuracy_key
    stats = Stats()
    for start in range(0, largest_share, deps.batch_prompts):
        encoded = deps.encoder.encode(samples[start:start + deps.batch_prompts])
        stats.add("eval/skipped", float(len(encoded.skipped)), 1.0)
        batch = encoded.batch
        rollouts = deps.engine.generate(batch, sampling)  # even on an empty batch: see the module docstring
        result = score_on_every_rank(deps.rewards, batch, rollouts, step, deps.rank, deps.gather_objects)
        if len(batch) == 0:
            continue
        correct = torch.nan_to_num(result.per_function.get(key, torch.full((len(rollouts),), float("nan"))),
                                   nan=0.0) > 0.5
        valid = ~torch.isnan(result.total)
        stats.add("eval/accuracy", correct.float().sum(), len(rollouts))
        stats.add("eval/reward/mean", torch.where(valid, result.total, torch.zeros(())).sum(), valid.sum())
        lengths = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float32)
        stats.add("eval/completions/mean_length", lengths.sum(), len(rollouts))
        if sampling.n > 1:
            solved = correct.view(-1, sampling.n).any(dim=1)
            stats.add(f"eval/pass@{sampling.n}", solved.float().sum(), solved.numel())
    stats.add("eval/accuracy", 0.0, 0.0)  # same keys on every rank, even one without eval samples
    stats.add("eval/reward/mean", 0.0, 0.0)
    stats.add("eval/completions/mean_length", 0.0, 0.0)
    stats.add("eval/skipped", 0.0, 0.0)
    if sampling.n > 1:
        stats.add(f"eval/pass@{sampling.n}", 0.0, 0.0)
    reduced = stats.reduce(deps.reduce)
    metrics = reduced.means()
    metrics["eval/skipped"] = float(reduced.sums["eval/skipped"])
    return metrics

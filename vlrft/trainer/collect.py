"""Collecting one step's rollouts: prompts -> completions -> rewards, with refills that keep groups whole.

Prompts a rank could not use (skipped as too long with `data.on_bad_sample=skip`) and, with
`algorithm.dynamic_sampling`, groups whose rewards all agree (zero variance: no learning signal)
are replaced by fresh prompts, round after round. Every rank runs the same number of rounds (the
decision is all-reduced), so the prompt stream and later collectives stay in step. If the refill
budget runs out, zero-variance groups fill the gap: they get zero advantage, never a 0/0.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager

import torch

from vlrft.algo import clip_rewards, overlong_penalty, zero_variance_groups
from vlrft.config import AlgorithmConfig, RolloutConfig
from vlrft.data import PromptBatch, PromptEncoder, PromptSampler
from vlrft.parallel.strategy import Strategy
from vlrft.errors import UserError
from vlrft.rollout.base import RolloutEngine, Rollouts, SamplingParams
from vlrft.trainer.experience import Timer, no_timer
from vlrft.trainer.out_of_memory import explain_out_of_memory

if TYPE_CHECKING:  # the reward package loads its built-ins (and their dependencies) when imported
    from vlrft.rewards import RewardSet

MAX_ROUNDS_FOR_SKIPS = 32  # rounds allowed to replace skipped prompts before giving up


@dataclass
class Collected:
    """This rank's share of a step: whole groups, rewards already shaped (NaN = not applicable)."""

    prompts: PromptBatch
    rollouts: Rollouts
    rewards: torch.Tensor  # [N] shaped scalar reward per completion
    per_function: dict[str, torch.Tensor]  # [N] raw reward per function (NaN = not applicable / not routed)
    groups_seen: int  # groups generated this step (all rounds)
    zero_std_groups: int  # of those, groups with zero reward variance
    filled_zero_std: int  # zero-variance groups kept because refills ran out
    skipped_prompts: int
    rounds: int
    reward_errors: dict[str, int] = field(default_factory=dict)  # function key -> calls lost to an error (all rounds)


@dataclass(frozen=True)
class CollectDeps:
    """What `collect` needs: where prompts come from, the engine that answers them, the rewards that score them."""

    algo: AlgorithmConfig  # dynamic sampling, refill rounds, reward shaping
    rollout: RolloutConfig  # group size n, length limits for the overlong penalty
    prompts_per_rank: int  # usable groups this rank must return
    samples: list  # the training samples the sampler's indices point into
    sampler: PromptSampler
    encoder: PromptEncoder
    engine: RolloutEngine
    sampling: SamplingParams
    rewards: RewardSet
    strategy: Strategy  # all_reduce: every rank runs the same number of rounds
    timer: Timer = no_timer
    sampling_memory_fixes: tuple[str, ...] = ()  # options that lower sampling's memory, named if the device runs out


def shape_rewards(total: torch.Tensor, rollouts: Rollouts, algo: AlgorithmConfig, rollout: RolloutConfig
                  ) -> torch.Tensor:
    """Overlong penalty and clipping of the combined reward (running normalisation happens per step)."""
    rewards = total.clone()
    if algo.overlong_buffer > 0:
        lengths = torch.tensor([len(c) for c in rollouts.completion_ids], dtype=torch.float32)
        limit = rollout.tokens_after_prompt  # with tools, the whole trajectory's budget
        rewards = rewards + overlong_penalty(lengths, limit, algo.overlong_buffer, algo.overlong_penalty)
    return clip_rewards(rewards, algo.reward_clip)


def score(reward_set, prompts: PromptBatch, rollouts: Rollouts, step: int):
    """Run the reward functions on every completion, with its prompt's columns repeated by index."""
    index = rollouts.prompt_index
    samples = [prompts.samples[i] for i in index]
    return reward_set.score(
        rollouts.texts,
        prompts=[prompts.prompt_texts[i] for i in index],
        completion_ids=rollouts.completion_ids,
        images=[prompts.images[i] for i in index],
        references=[s.answer for s in samples],
        labels=[s.label for s in samples],
        extras=[s.extra for s in samples],
        step=step,
    )


def score_on_every_rank(reward_set, prompts: PromptBatch, rollouts: Rollouts, step: int, rank: int,
                        gather_objects: Callable[[Any], list], timer: ContextManager | None = None):
    """`score` of this rank's batch (None for an empty one; timed by `timer`); then every rank learns whether some
    rank's scoring failed and raises it too, naming that rank, instead of waiting in the next collective until the
    launcher stops it without a word of why. Every rank calls it once per round, its batch empty or not.

    A reward error (reward.on_error=raise) is raised as one RewardError everywhere; any other exception is
    re-raised as it is on its own rank (its traceback kept), and named in the RewardError of the others.
    """
    result, failure, own = None, None, None
    if len(prompts):
        with timer or contextlib.nullcontext():
            try:
                result = score(reward_set, prompts, rollouts, step)
            except Exception as exc:  # noqa: BLE001 - told to every rank, then raised
                expected = isinstance(exc, UserError)  # a RewardError
                failure = f"rank {rank}: {exc}" if expected else f"rank {rank}: {type(exc).__name__}: {exc}"
                own = None if expected else exc
    failures = [f for f in gather_objects(failure) if f is not None]
    if own is not None:
        raise own
    if failures:
        from vlrft.rewards.types import RewardError

        raise RewardError(failures[0] + (f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""))
    return result


@dataclass(frozen=True)
class ScoredGroups:
    """One round's prompts, rollouts and shaped rewards, and which of its groups (prompt indices) to use, in order."""

    prompts: PromptBatch
    rollouts: Rollouts
    rewards: torch.Tensor  # [N] shaped reward per completion of the round
    per_function: dict[str, torch.Tensor]  # [N] raw reward per function
    groups: tuple[int, ...]


@dataclass(frozen=True)
class RoundCounts:
    """What a step's rounds counted, reported in `Collected` beside its rows."""

    groups_seen: int
    zero_std_groups: int
    filled_zero_std: int
    skipped_prompts: int
    rounds: int
    reward_errors: dict[str, int]


@dataclass(frozen=True)
class Selection:
    """What `collect` hands `_assemble`: the scored groups to take, in order, until `need` groups; the counts."""

    parts: tuple[ScoredGroups, ...]
    need: int
    counts: RoundCounts


def collect(deps: CollectDeps, step: int) -> Collected:
    """Generate and score until this rank has `prompts_per_rank` usable groups (see the module docstring)."""
    n = deps.rollout.n
    need = deps.prompts_per_rank
    dynamic = deps.algo.dynamic_sampling
    kept: list[ScoredGroups] = []
    spare: list[ScoredGroups] = []
    have = groups_seen = zero_groups = skipped = rounds = 0
    reward_errors = dict.fromkeys(deps.rewards.keys, 0)
    max_rounds = (1 + deps.algo.max_refill_rounds) if dynamic else MAX_ROUNDS_FOR_SKIPS
    while True:
        short = torch.tensor([float(have < need)])
        if rounds >= max_rounds or deps.strategy.all_reduce(short, "max").item() == 0:
            break
        rounds += 1
        indices = deps.sampler.next_indices()
        encoded = deps.encoder.encode([deps.samples[i] for i in indices])
        skipped += len(encoded.skipped)
        batch = encoded.batch
        sampling = explain_out_of_memory(f"step {step}, sampling completions (rollout.engine={deps.rollout.engine})",
                                         deps.sampling_memory_fixes)
        with deps.timer("time/generate"), sampling:
            # Also on an empty batch: ranks sharing a tensor-parallel engine must call it in lockstep.
            rollouts = deps.engine.generate(batch, deps.sampling)
        result = score_on_every_rank(deps.rewards, batch, rollouts, step, deps.strategy.rank,
                                     deps.strategy.all_gather_object, timer=deps.timer("time/reward"))
        if len(batch) == 0:
            continue
        for key in reward_errors:
            reward_errors[key] += int(result.stats[key].errors) if key in result.stats else 0
        total = rollouts.with_tool_rewards(result.total)  # multi-turn: reward parts returned by tools
        rewards = shape_rewards(total, rollouts, deps.algo, deps.rollout)
        zero = zero_variance_groups(rewards, n)
        groups_seen += len(batch)
        zero_groups += int(zero.sum())
        good = tuple(g for g in range(len(batch)) if not (dynamic and bool(zero[g])))
        bad = tuple(g for g in range(len(batch)) if dynamic and bool(zero[g]))
        scored = ScoredGroups(prompts=batch, rollouts=rollouts, rewards=rewards, per_function=result.per_function,
                              groups=good)
        if good:
            kept.append(scored)
            have += len(good)
        if bad:
            spare.append(dataclasses.replace(scored, groups=bad))
    filled = 0
    if have < need:
        available = sum(len(s.groups) for s in spare)
        if have + available < need:
            raise UserError(f"could not collect {need} usable prompts for this rank in {rounds} rounds "
                            f"({skipped} prompts skipped as bad); check the data with `vlrft data check` or set "
                            "data.on_bad_sample=error to see why")
        filled = need - have
        kept.extend(spare)
    counts = RoundCounts(groups_seen=groups_seen, zero_std_groups=zero_groups, filled_zero_std=filled,
                         skipped_prompts=skipped, rounds=rounds, reward_errors=reward_errors)
    return _assemble(Selection(parts=tuple(kept), need=need, counts=counts))


def _assemble(selection: Selection) -> Collected:
    """The first `selection.need` groups of its parts as one batch."""
    batches, rollouts, rewards, functions = [], [], [], []
    left = selection.need
    for part in selection.parts:
        groups = list(part.groups[:left])
        if not groups:
            break
        left -= len(groups)
        n = part.rollouts.n
        rows = torch.tensor([g * n + j for g in groups for j in range(n)])
        batches.append(part.prompts.select(groups))
        rollouts.append(part.rollouts.select_groups(groups))
        rewards.append(part.rewards[rows])
        functions.append({name: values[rows] for name, values in part.per_function.items()})
    names = sorted({name for f in functions for name in f})
    per_function = {name: torch.cat([f.get(name, torch.full((len(r),), float("nan")))
                                     for f, r in zip(functions, rewards)]) for name in names}
    counts = selection.counts
    return Collected(prompts=PromptBatch.concat(batches), rollouts=Rollouts.concat(rollouts),
                     rewards=torch.cat(rewards), per_function=per_function, groups_seen=counts.groups_seen,
                     zero_std_groups=counts.zero_std_groups, filled_zero_std=counts.filled_zero_std,
                     skipped_prompts=counts.skipped_prompts, rounds=counts.rounds, reward_errors=counts.reward_errors)

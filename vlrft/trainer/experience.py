"""From collected rollouts to training tensors: masks, old/ref logprobs, values, advantages.

Only what the configuration needs is computed: no reference forward when the KL coefficient is 0,
no extra old-logprob pass when training is fully on-policy (one PPO epoch, one mini-batch: the
ratio is 1 by construction), no critic unless GAE is used.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vlrft.algo import compute_advantages, kl_reward_penalty
from vlrft.batch import SequenceBatch
from vlrft.config import AlgorithmConfig
from vlrft.trainer.micro_batches import MicroBatch, RowLengths, by_row_count, by_token_budget, padded_to_count

Reduce = Callable[[torch.Tensor], torch.Tensor]
Timer = Callable[[str], contextlib.AbstractContextManager]


def no_timer(_name: str) -> contextlib.AbstractContextManager:
    """A `Timer` that measures nothing (tests, tools that call a phase alone)."""
    return contextlib.nullcontext()


class PhaseTimer:
    """A `Timer` that sums the seconds of each named phase until `take` hands them over and starts afresh: the
    trainer's per step, and the async producer's per collection (kept apart: the trainer starts a step while the
    producer's thread collects the next)."""

    def __init__(self):
        self._times: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] += time.perf_counter() - start

    @contextlib.contextmanager
    def untimed(self, name: str) -> Iterator[None]:
        """Time spent inside is left out of phase `name`, which encloses it (the async producer's wait for its turn
        to sample is not generation)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] -= time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The phases timed since the last `take`, and a fresh start."""
        out, self._times = dict(self._times), defaultdict(float)
        return out


@dataclass(frozen=True)
class Batching:
    """How this rank turns collected rows into model inputs: padded, on its device, in micro-batches."""

    pad_id: int  # the tokenizer's pad token
    device: torch.device
    micro_batch: int  # completions per forward pass (train.micro_batch_completions_per_rank)
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # mixed precision, if any
    # train.max_tokens_per_micro_batch: > 0 forms micro-batches by this token budget (vlrft.trainer.micro_batches)
    max_tokens: int = 0
    share_prompts: bool = True  # the policy runs each distinct prompt once per micro-batch (what the budget counts)
    split_widths: bool = True  # ... and its completions in classes of similar length (ActorVL, not under sharding)
    agree_count: Callable[[int], int] | None = None  # max over ranks of a micro-batch count (None: one process)
    message: Callable[[str], None] = print  # where the one note about a row over the budget goes


@dataclass(frozen=True)
class ExperienceDeps:
    """What `make_experience` needs: the models whose logprobs/values it scores and the advantage settings."""

    algo: AlgorithmConfig
    group_size: int  # completions per prompt (rollout.n)
    batching: Batching
    temperature: float  # logprobs are taken at the sampling temperature
    kl_coef: float  # the KL controller's current coefficient
    old_policy: torch.nn.Module | None  # the actor, when old logprobs need their own pass (off-policy); else None
    ref: torch.nn.Module | None = None  # reference policy (KL), None when the KL coefficient is 0
    critic: torch.nn.Module | None = None  # value model (GAE)
    reduce: Reduce | None = None  # sum over ranks, for group statistics (None: one process)
    timer: Timer = no_timer


@dataclass
class Experience:
    """Per-completion tensors of this rank's share of a step, padded to the widest completion C."""

    mask: torch.Tensor  # [N, C] float: completion tokens that train (truncated rows removed by config)
    token_mask: torch.Tensor  # [N, C] float: every generated token
    advantages: torch.Tensor  # [N, C]
    returns: torch.Tensor | None  # [N, C] (GAE)
    old_logprobs: torch.Tensor | None  # [N, C] None when on-policy
    ref_logprobs: torch.Tensor | None  # [N, C] None when kl_coef == 0
    engine_logprobs: torch.Tensor | None  # [N, C]
    values: torch.Tensor | None  # [N, C] (GAE)
    valid: torch.Tensor  # [N] bool: the reward was applicable
    advantage_stats: object  # vlrft.algo.Stats
    # [N, C] with the rollout's top-k / top-p / min-p and an old-policy pass: the log of the mass they keep of the old
    # policy's distribution (`ActorVL.sampling_truncation`), which TIS adds to the engine's truncated logprobs
    old_kept_log_mass: torch.Tensor | None = None

    def row_advantage(self, row: int) -> float:
        """Row `row`'s mean advantage over its sampled tokens (`token_mask`), 0.0 for a row with none.

        Averaged over the masked positions, not over the first `token_mask.sum()` positions: a multi-turn row's mask
        has holes at the tool observations, so its count of sampled tokens is not where they end.
        """
        mask = self.token_mask[row].bool()
        return float(self.advantages[row][mask].float().mean()) if bool(mask.any()) else 0.0


def padded(rows: list[list[float]] | list[list[int]], width: int, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.as_tensor(row[:width], dtype=dtype)
    return out


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    return by_row_count(rows, size)


_oversized_noted = False


def plan_micro_batches(batching: Batching, collected, rows: list[int], spare: list[int] | None = None
                       ) -> list[MicroBatch]:
    """This rank's forwards over `rows`: by row count, or by token budget with a count agreed over ranks.

    `spare`: rows this rank holds but leaves out (rows whose loss is 0). Then `rows` may differ in
    number between ranks, so the count is agreed over ranks in both modes, a rank short of rows runs
    fillers (weight 0) from `rows`, else from `spare`, and at least one forward runs even when no rank
    has a row, so the backward still leaves every gradient (zero) as training on the rows would.
    """
    if batching.max_tokens <= 0:
        micro, lengths = micro_batches(rows, batching.micro_batch), None
        if spare is None:  # every rank has its full share of rows: the counts already agree
            return [MicroBatch(m) for m in micro]
    else:
        lengths = RowLengths.of(collected.prompts.prompt_ids, collected.rollouts.completion_ids,
                                collected.rollouts.prompt_index)

        def note(row: int, tokens: int) -> None:
            global _oversized_noted
            if not _oversized_noted:
                _oversized_noted = True
                batching.message(f"note: a training row needs {tokens} tokens, over train.max_tokens_per_micro_batch="
                                 f"{batching.max_tokens}; such rows form micro-batches of their own (said once)")

        micro = by_token_budget(lengths, rows, batching.max_tokens, batching.share_prompts, note, batching.split_widths)
    count = len(micro) if batching.agree_count is None else batching.agree_count(len(micro))
    return padded_to_count(micro, max(count, int(spare is not None)), lengths, batching.share_prompts,
                           batching.split_widths, spare=spare)


def sequences_for(batching: Batching, collected, rows: list[int]) -> SequenceBatch:
    """Training rows `rows` of this step, on this rank's device (`Rollouts.sequences`: single- and multi-turn)."""
    return collected.rollouts.sequences(collected.prompts, rows, batching.pad_id).to(batching.device)


@torch.no_grad()
def forward_pass(batching: Batching, collected, model, width: int, fn):
    """Run `fn(model, seqs) -> [B, c]` over micro-batches of all rows, padded into one [N, width] tensor (or a tuple
    of such tensors when `fn` returns a tuple)."""
    n_rows = len(collected.rollouts)
    outs: list[torch.Tensor] | None = None
    several = False
    for micro in plan_micro_batches(batching, collected, list(range(n_rows))):
        seqs = sequences_for(batching, collected, micro.rows)
        with batching.autocast():
            values = fn(model, seqs)
        several = isinstance(values, tuple)
        values = values if several else (values,)
        if outs is None:
            outs = [torch.zeros((n_rows, width), dtype=torch.float32) for _ in values]
        if not micro.filler:
            for out, value in zip(outs, values):
                out[micro.rows, :value.shape[1]] = value.float().cpu()
    if outs is None:
        outs = [torch.zeros((n_rows, width), dtype=torch.float32)]
    return tuple(outs) if several else outs[0]


def training_masks(completion_ids: list[list[int]], truncated: list[bool], mask_truncated: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_mask, loss_mask) [N, C]: every generated token; the tokens that train (truncated rows zeroed)."""
    width = max(1, max((len(c) for c in completion_ids), default=1))
    token_mask = padded([[1.0] * len(c) for c in completion_ids], width)
    mask = token_mask.clone()
    if mask_truncated:
        mask[torch.tensor(truncated, dtype=torch.bool)] = 0.0
    return token_mask, mask


def score_advantages(algo, rewards: torch.Tensor, token_mask: torch.Tensor, group_size: int, *,
                     old: torch.Tensor | None, ref: torch.Tensor | None, kl_coef: float,
                     values: torch.Tensor | None = None, reduce=None):
    """Advantages from every generated token, so each row of a group is scored the same way.

    With `kl_in: reward` a row's score is reward - coef * sum of KL over all its tokens, truncated
    rows included: `mask_truncated` removes a row's gradient (the loss mask), never its KL term,
    so the group mean/std compare like with like.
    """
    token_rewards = None
    if algo.kl_in == "reward" and ref is not None and kl_coef > 0:
        token_rewards = kl_reward_penalty(old, ref, token_mask.bool(), kl_coef, algo.kl_estimator, algo.kl_k3_clamp)
    return compute_advantages(algo, rewards, token_mask.bool(), group_size, values=values,
                              token_rewards=token_rewards, reduce=reduce)


def make_experience(deps: ExperienceDeps, collected) -> Experience:
    """Masks, old/ref logprobs, values and advantages for this rank's collected rows."""
    algo = deps.algo
    rollouts = collected.rollouts
    token_mask, mask = training_masks(rollouts.completion_ids, rollouts.truncated, algo.mask_truncated)
    sampled = padded(rollouts.sampled, token_mask.shape[1])  # multi-turn: tool outputs and templates never train
    token_mask, mask = token_mask * sampled, mask * sampled
    width = token_mask.shape[1]
    temperature = deps.temperature
    # Through __call__ (= logprobs): a sharded module gathers its root parameters in forward hooks.
    logprob_fn = lambda model, seqs: model(seqs, temperature).logprobs  # noqa: E731

    with deps.timer("time/logprobs"):
        old = old_kept = None
        if deps.old_policy is not None:
            if rollouts.logprobs is not None and getattr(deps.old_policy, "sampling_truncation", None) is not None:
                both = lambda model, seqs: tuple(model(seqs, temperature)[::2])  # noqa: E731  logprobs, kept mass
                old, old_kept = forward_pass(deps.batching, collected, deps.old_policy, width, both)
            else:
                old = forward_pass(deps.batching, collected, deps.old_policy, width, logprob_fn)
        ref = None
        if deps.ref is not None:
            ref = forward_pass(deps.batching, collected, deps.ref, width, logprob_fn)
        values = None
        if deps.critic is not None:
            values = forward_pass(deps.batching, collected, deps.critic, width, lambda m, s: m(s))
    engine = None if rollouts.logprobs is None else padded(rollouts.logprobs, width)

    result = score_advantages(algo, collected.rewards, token_mask, deps.group_size, old=old, ref=ref,
                              kl_coef=deps.kl_coef, values=values, reduce=deps.reduce)
    return Experience(mask=mask * result.valid[:, None].float(), token_mask=token_mask, advantages=result.advantages,
                      returns=result.returns, old_logprobs=old, ref_logprobs=ref, engine_logprobs=engine,
                      values=values, valid=result.valid, advantage_stats=result.stats, old_kept_log_mass=old_kept)

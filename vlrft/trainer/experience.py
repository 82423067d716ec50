"""From collected rollouts to training tensors: masks, old/ref logprobs, values, advantages.

Only what the configuration needs is computed: no reference forward when the KL coefficient is 0,
no extra old-logprob pass when training is fully on-policy (one PPO epoch, one mini-batch: the
ratio is 1 by construction), no critic unless GAE is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.algo import compute_advantages, kl_reward_penalty
from vlrft.batch import SequenceBatch, build_sequences


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


def padded(rows: list[list[float]] | list[list[int]], width: int, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.as_tensor(row[:width], dtype=dtype)
    return out


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def sequences_for(trainer, collected, rows: list[int]) -> SequenceBatch:
    """Training rows `rows` of this step, on the trainer's device."""
    if hasattr(collected.rollouts, "sequences"):  # multi-turn trajectories (vlrft.rollout.multiturn)
        return collected.rollouts.sequences(collected.prompts, rows, trainer.tokens.pad_id).to(trainer.device)
    return build_sequences(collected.prompts.prompt_ids, collected.prompts.visual,
                           collected.rollouts.completion_ids, collected.rollouts.prompt_index,
                           trainer.tokens.pad_id, rows).to(trainer.device)


@torch.no_grad()
def forward_pass(trainer, collected, model, width: int, fn) -> torch.Tensor:
    """Run `fn(model, seqs) -> [B, c]` over micro-batches of all rows, padded into one [N, width] tensor."""
    n_rows = len(collected.rollouts)
    out = torch.zeros((n_rows, width), dtype=torch.float32)
    for rows in micro_batches(list(range(n_rows)), trainer.cfg.train.micro_batch_completions_per_rank):
        seqs = sequences_for(trainer, collected, rows)
        with trainer.autocast():
            values = fn(model, seqs).float().cpu()
        out[rows, :values.shape[1]] = values
    return out


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


def make_experience(trainer, collected) -> Experience:
    cfg = trainer.cfg
    algo = cfg.algorithm
    rollouts = collected.rollouts
    token_mask, mask = training_masks(rollouts.completion_ids, rollouts.truncated, algo.mask_truncated)
    if hasattr(rollouts, "sampled_mask"):  # multi-turn: tool outputs, images and templates never train
        sampled = padded(rollouts.sampled_mask, token_mask.shape[1])
        token_mask, mask = token_mask * sampled, mask * sampled
    width = token_mask.shape[1]
    temperature = trainer.train_temperature
    # Through __call__ (= logprobs): a sharded module gathers its root parameters in forward hooks.
    logprob_fn = lambda model, seqs: model(seqs, temperature).logprobs  # noqa: E731

    with trainer.timer("time/logprobs"):
        old = None
        if trainer.needs_old_logprobs:
            old = forward_pass(trainer, collected, trainer.actor, width, logprob_fn)
        ref = None
        if trainer.ref is not None:
            ref = forward_pass(trainer, collected, trainer.ref, width, logprob_fn)
        values = None
        if trainer.critic is not None:
            values = forward_pass(trainer, collected, trainer.critic, width, lambda m, s: m(s))
    engine = None if rollouts.logprobs is None else padded(rollouts.logprobs, width)

    result = score_advantages(algo, collected.rewards, token_mask, cfg.rollout.n, old=old, ref=ref,
                              kl_coef=trainer.kl_controller.value, values=values, reduce=trainer.sum_reduce)
    return Experience(mask=mask * result.valid[:, None].float(), token_mask=token_mask, advantages=result.advantages,
                      returns=result.returns, old_logprobs=old, ref_logprobs=ref, engine_logprobs=engine,
                      values=values, valid=result.valid, advantage_stats=result.stats)

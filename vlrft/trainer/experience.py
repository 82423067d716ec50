"""From collected rollouts to training tensors: masks, old/ref logprobs, values, advantages.

Only what the configuration needs is computed: no reference forward when the KL coefficient is 0,
no extra old-logprob pass when training is fully on-policy (one PPO epoch, one mini-batch: the
ratio is 1 by construction), no critic unless GAE is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.algo import compute_advantages, kl_reward_penalty
from vlrft.trainer.sequences import SequenceBatch, build_sequences


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
    return build_sequences(collected.prompts.prompt_ids, collected.prompts.visual,
                           collected.rollouts.completion_ids, collected.rollouts.prompt_index,
                           trainer.tokens.pad_id, rows).to(trainer.device)


@torch.no_grad()
def forward_pass(trainer, collected, model, width: int, fn) -> torch.Tensor:
    """Run `fn(model, seqs) -> [B, c]` over micro-batches of all rows, padded into one [N, width] tensor."""
    n_rows = len(collected.rollouts)
    out = torch.zeros((n_rows, width), dtype=torch.float32)
    for rows in micro_batches(list(range(n_rows)), trainer.cfg.train.micro_batch_size):
        seqs = sequences_for(trainer, collected, rows)
        with trainer.autocast():
            values = fn(model, seqs).float().cpu()
        out[rows, :values.shape[1]] = values
    return out


def make_experience(trainer, collected) -> Experience:
    cfg = trainer.cfg
    algo = cfg.algorithm
    rollouts = collected.rollouts
    width = max(1, max(len(c) for c in rollouts.completion_ids))
    token_mask = padded([[1.0] * len(c) for c in rollouts.completion_ids], width)
    mask = token_mask.clone()
    if algo.mask_truncated:
        mask[torch.tensor(rollouts.truncated, dtype=torch.bool)] = 0.0
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

    token_rewards = None
    if algo.kl_in == "reward" and ref is not None and trainer.kl_controller.value > 0:
        token_rewards = kl_reward_penalty(old, ref, mask.bool(), trainer.kl_controller.value, algo.kl_estimator)
    result = compute_advantages(algo, collected.rewards, mask.bool(), cfg.rollout.n, values=values,
                                token_rewards=token_rewards, reduce=trainer.sum_reduce)
    return Experience(mask=mask * result.valid[:, None].float(), token_mask=token_mask, advantages=result.advantages,
                      returns=result.returns, old_logprobs=old, ref_logprobs=ref, engine_logprobs=engine,
                      values=values, valid=result.valid, advantage_stats=result.stats)

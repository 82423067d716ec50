"""Policy losses (PPO clip, GSPO, CPGD) with exact loss aggregation, and the clipped value loss.

Denominator convention (what makes gradient accumulation exact): the trainer computes, once per
optimizer step, the denominators of the WHOLE mini-batch over all ranks and all micro-batches
with `loss_denominators(mini_batch_mask, reduce=all_reduce_sum)`, passes them to every
micro-batch's `policy_loss(..., num_tokens=d.num_tokens, num_seqs=d.num_seqs,
world_size=W)`, calls backward on each micro-batch loss (gradients add up), and lets
DDP / FSDP / ZeRO average gradients over the W ranks. Each loss is multiplied by `world_size`
to undo that averaging, so the final gradient is exactly that of the single-batch loss
sum(all token terms) / (global denominator). Left as None, the denominators default to this call's
own counts (right for one micro-batch on one rank).

Aggregation modes (l = per-token loss, m = mask, i = sequence):
  token-mean               sum_i,t l m / num_tokens                      (DAPO)
  seq-mean-token-mean      sum_i (sum_t l m / len_i) / num_seqs          (GRPO paper, GSPO)
  seq-mean-token-sum       sum_i,t l m / num_seqs
  seq-mean-token-sum-norm  sum_i,t l m / (num_seqs * max_tokens)         (Dr. GRPO; max_tokens = max_new_tokens)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from vlrft.algo.kl import kl_estimate
from vlrft.algo.stats import Stats
from vlrft.config import AlgorithmConfig
from vlrft.errors import UserError
from vlrft.registry import POLICY_LOSSES as POLICY_LOSS_REGISTRY

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: large enough never to matter, small enough never to overflow


@dataclass(frozen=True)
class LossOutput:
    """A scalar loss to call backward on, and its metrics as sums and counts (reduce across ranks exactly)."""

    loss: Tensor
    stats: Stats


@dataclass(frozen=True)
class LossDenominators:
    """Counts over the whole mini-batch (all micro-batches, all ranks) that every micro-batch loss divides by."""

    num_tokens: Tensor  # valid completion tokens
    num_seqs: Tensor  # sequences with at least one valid token


def loss_denominators(mask: Tensor, reduce: Callable[[Tensor], Tensor] | None = None) -> LossDenominators:
    """Count tokens and sequences of a mini-batch mask [N, T]; `reduce` (sum-all-reduce) makes it global."""
    mask = mask.bool()
    packed = torch.stack([mask.sum(), mask.any(dim=1).sum()]).to(torch.float64)
    if reduce is not None:
        packed = reduce(packed)
    return LossDenominators(num_tokens=packed[0], num_seqs=packed[1])


def aggregate(values: Tensor, mask: Tensor, mode: str, *, num_tokens: Tensor | float | None = None,
              num_seqs: Tensor | float | None = None, max_tokens: int | None = None,
              lengths: Tensor | None = None, token_share: float = 1.0) -> Tensor:
    """Reduce per-token `values` [N, T] over `mask` to a scalar with one of `LOSS_AGG_MODES`.

    `lengths` (default: the mask's row sums) are the per-sequence token counts of
    seq-mean-token-mean. `token_share` (high-entropy masking keeps that share of tokens) scales the
    denominators that count tokens, so the loss stays an average over the tokens actually trained.
    Denominators are clamped to at least 1: an all-masked batch gives 0, never 0/0.
    """
    m = mask.to(values.dtype)
    total = values * m
    device, dtype = values.device, values.dtype
    if num_tokens is None:
        num_tokens = mask.sum()
    if num_seqs is None:
        num_seqs = mask.any(dim=1).sum()
    num_tokens = torch.as_tensor(num_tokens, device=device).to(dtype)
    num_seqs = torch.as_tensor(num_seqs, device=device).to(dtype).clamp(min=1)
    if mode == "token-mean":
        return total.sum() / (num_tokens * token_share).clamp(min=1)
    if mode == "seq-mean-token-mean":
        lengths = m.sum(dim=1) if lengths is None else lengths.to(dtype)
        return (total.sum(dim=1) / (lengths * token_share).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return total.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return total.sum() / (num_seqs * float(max_tokens if max_tokens is not None else mask.shape[1]))
    raise UserError(f"config: algorithm.loss_agg={mode!r} is not allowed; expected one of {', '.join(LOSS_AGG_MODES)}")


# ----------------------------------------------------------------------------------------------
# per-token surrogates behind a registry


@dataclass(frozen=True)
class Surrogate:
    """Per-token policy-gradient loss of one method, plus where its clip bound."""

    per_token: Tensor  # [N, T] loss per token, before aggregation
    clipped_low: Tensor  # [N, T] bool: ratio below 1 - eps_low with A < 0 (the clip binds there)
    clipped_high: Tensor  # [N, T] bool: ratio above 1 + eps_high with A > 0
    dual_clipped: Tensor | None = None  # [N, T] bool: the dual-clip bound applied (A < 0, ratio > c)
    regularizer: Tensor | None = None  # [N, T] extra per-token loss term, already weighted (CPGD's policy drift)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # extra per-token values to log as masked means


SurrogateFn = Callable[[AlgorithmConfig, Tensor, Tensor, Tensor, Tensor], Surrogate]
POLICY_LOSSES: dict[str, SurrogateFn] = POLICY_LOSS_REGISTRY.entries


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[SurrogateFn], SurrogateFn]:
    """Decorator adding a per-token surrogate `fn(cfg, logprobs, old_logprobs, advantages, mask) -> Surrogate`.

    A different function under a taken name is an error unless `override=True` (vlrft.registry's rule).
    """
    return POLICY_LOSS_REGISTRY.register(name, override=override)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                       dual_clip: float | None) -> Surrogate:
    """-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A), with the dual-clip bound -c A for A < 0 when set.

    Clip fractions count only tokens where the clip binds given A's sign, measured on the ratio
    before clamping (docs/design.md, "Traps"): above 1+eps_high with A > 0, below 1-eps_low with A < 0.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    ratio_now = ratio.detach()
    high = (advantages > 0) & (ratio_now > 1.0 + eps_high)
    low = (advantages < 0) & (ratio_now < 1.0 - eps_low)
    dual = None
    if dual_clip is not None:
        # Ye et al. 2020 (arXiv:1912.09729): for A < 0 the loss -rho A grows without bound in rho; cap it at -c A
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (per_token.detach() > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    return Surrogate(per_token=per_token, clipped_low=low, clipped_high=high, dual_clipped=dual)


@register_policy_loss("ppo")
def ppo_surrogate(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                  mask: Tensor) -> Surrogate:
    """PPO clip (arXiv:1707.06347) on the token ratio exp(logp - logp_old), clip-higher via eps_low != eps_high."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return _clipped_surrogate(ratio, advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N]: mean over a sequence's valid tokens of logp - logp_old, i.e. log of GSPO's s_i."""
    m = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


@register_policy_loss("gspo")
def gspo_surrogate(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                   mask: Tensor) -> Surrogate:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), token form: s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)].

    s_i = (pi(y_i) / pi_old(y_i)) ^ (1/|y_i|) is the length-normalised sequence ratio; every token
    of sequence i carries its value and the sequence-level gradient. Clipped with
    gspo_clip_eps_low / gspo_clip_eps_high (far tighter than token-level PPO).
    """
    seq = sequence_log_ratio(logprobs, old_logprobs, mask).detach()
    log_s = (logprobs - logprobs.detach() + seq[:, None]).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    sur = _clipped_surrogate(torch.exp(log_s), advantages, cfg.gspo_clip_eps_low, cfg.gspo_clip_eps_high,
                             cfg.dual_clip)
    seq_ratio = torch.exp(seq.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return replace(sur, metrics={"actor/gspo_seq_ratio": seq_ratio[:, None].expand_as(mask)})


@register_policy_loss("cpgd")
def cpgd_surrogate(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                   mask: Tensor) -> Surrogate:
    """CPGD (Liu et al. 2025, arXiv:2505.12504): clipped policy gradient on the LOG ratio, plus policy drift.

    Per token, with d = logp - logp_old:
      pg    = -min(d A, clip(d, ln(1-eps_low), ln(1+eps_high)) A)
            = -A * (min(d, ln(1+eps_high)) if A > 0 else max(d, ln(1-eps_low)))
      drift = alpha * KL(pi_old || pi_theta), estimated per token by k3 = rho - 1 - d (rho = e^d),
              whose gradient (rho - 1) grad(logp) is capped at rho - 1 <= cpgd_drift_clip as in the
              reference implementation; its value is the k3 estimate, so it logs as a KL.
    The ratio never multiplies the gradient of the pg term, which is what keeps CPGD stable.
    """
    d = logprobs - old_logprobs
    d_now = d.detach()
    hi, lo = math.log1p(cfg.clip_eps_high), math.log1p(-cfg.clip_eps_low)
    clipped_d = torch.where(advantages > 0, d.clamp(max=hi), d.clamp(min=lo))
    per_token = -advantages * clipped_d
    d_safe = d_now.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = torch.exp(d_safe)
    k3 = rho - 1.0 - d_safe
    regularizer = None
    if cfg.cpgd_drift_coef > 0:
        grad_coef = (rho - 1.0).clamp(max=cfg.cpgd_drift_clip)
        # value k3, gradient grad_coef * grad(logp): the second term only carries the value
        regularizer = cfg.cpgd_drift_coef * (grad_coef * (logprobs - logprobs.detach()) + k3)
    return Surrogate(per_token=per_token, clipped_low=(advantages < 0) & (d_now < lo),
                     clipped_high=(advantages > 0) & (d_now > hi), regularizer=regularizer,
                     metrics={"actor/policy_drift_k3": k3})


# ----------------------------------------------------------------------------------------------


def zero_advantage_rows_add_nothing(cfg: AlgorithmConfig, kl_coef: float) -> bool:
    """Whether a row whose advantage is 0 at every token adds exactly nothing to `policy_loss` or its gradient.

    True for the built-in surrogates (each token's loss is A times a finite factor) when no other term
    sees the row: no KL in the loss, no entropy bonus, no CPGD drift, no MoE router loss (every row's tokens
    are routed), and no high-entropy token selection (which ranks a micro-batch's tokens together). A registered or user surrogate may add
    terms of its own, so it is never assumed.
    """
    surrogate = POLICY_LOSS_REGISTRY.resolve(cfg.policy_loss)  # the function itself: a name can be overridden
    surrogate_is_linear = surrogate in (ppo_surrogate, gspo_surrogate) or (
        surrogate is cpgd_surrogate and cfg.cpgd_drift_coef <= 0)
    return (surrogate_is_linear and cfg.entropy_coef == 0.0 and cfg.router_aux_loss_coef == 0.0
            and not (cfg.kl_in == "loss" and kl_coef > 0)
            and (cfg.high_entropy_token_frac is None or cfg.high_entropy_token_frac >= 1.0))


def high_entropy_mask(entropy: Tensor, mask: Tensor, frac: float) -> Tensor:
    """Bool [N, T]: the top `frac` of valid tokens by entropy (ceil(frac * n) of them, ties kept).

    From "Beyond the 80/20 rule" (Wang et al. 2025, arXiv:2506.01939). The threshold is computed
    over the tokens of this call (one micro-batch), an approximation of the paper's batch-wide one.
    """
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return mask
    k = max(1, math.ceil(frac * n))
    flat = entropy.detach().masked_fill(~mask, float("-inf")).flatten()
    threshold = flat.topk(k).values[-1]
    return mask & (entropy.detach() >= threshold)


def policy_loss(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                entropy: Tensor | None = None, engine_logprobs: Tensor | None = None,
                ref_logprobs: Tensor | None = None, kl_coef: float = 0.0, num_tokens: Tensor | float | None = None,
                num_seqs: Tensor | float | None = None, max_tokens: int | None = None,
                world_size: int = 1) -> LossOutput:
    """The actor's loss for one micro-batch: surrogate (cfg.policy_loss) [+ drift] - entropy bonus + KL.

    All tensors are [N, T]; only `logprobs` (and `entropy`, for the bonus) carry gradients.
    - tis_cap: the surrogate of each token is multiplied by min(exp(logp_old - logp_engine), tis_cap),
      correcting for the rollout engine's numerics differing from the trainer's (needs engine_logprobs).
    - high_entropy_token_frac: only that top share of tokens by entropy gets the policy gradient.
    - KL to the reference is added only when cfg.kl_in == "loss" and kl_coef > 0 (kl_coef comes from
      the KL controller); with kl_in == "reward" it was already shaped into the rewards and is only logged.
    See the module docstring for `num_tokens` / `num_seqs` / `world_size`; count the denominators
    over the same mask passed here (e.g. `mask & advantages.valid[:, None]` to drop not-applicable rows).
    """
    surrogate = POLICY_LOSS_REGISTRY.resolve(cfg.policy_loss)  # a registered name, module:function or path.py:function
    mask = mask.bool()
    # float32 throughout: bf16 log-ratios near 0 lose the precision the clip decisions depend on
    logprobs = logprobs.float()
    old_logprobs, advantages = old_logprobs.detach().float(), advantages.detach().float()
    entropy = None if entropy is None else entropy.float()
    sur = surrogate(cfg, logprobs, old_logprobs, advantages, mask)
    pg = sur.per_token
    stats = Stats()

    if cfg.tis_cap is not None:
        if engine_logprobs is None:
            raise UserError("algorithm.tis_cap is set but the rollout engine returned no logprobs; "
                            "use an engine that reports them or set algorithm.tis_cap: null")
        # min(exp(x), cap) computed as exp(min(x, log cap)): no overflow for large x
        log_w = (old_logprobs - engine_logprobs.detach()).clamp(max=math.log(cfg.tis_cap))
        weight = torch.exp(log_w.clamp(min=-_MAX_LOG_RATIO))
        pg = pg * weight
        stats.add_masked("actor/tis_weight_mean", weight, mask)

    pg_mask, share = mask, 1.0
    if cfg.high_entropy_token_frac is not None and cfg.high_entropy_token_frac < 1.0:
        if entropy is None:
            raise UserError("algorithm.high_entropy_token_frac is set, which needs per-token entropies; "
                            "the trainer must pass `entropy`")
        pg_mask, share = high_entropy_mask(entropy, mask, cfg.high_entropy_token_frac), cfg.high_entropy_token_frac

    # defaults count the full mask: with entropy masking pg_mask is smaller, and token_share accounts for that
    agg = dict(num_tokens=mask.sum() if num_tokens is None else num_tokens,
               num_seqs=mask.any(dim=1).sum() if num_seqs is None else num_seqs, max_tokens=max_tokens)
    loss = aggregate(pg, pg_mask, cfg.loss_agg, lengths=mask.sum(dim=1), token_share=share, **agg)
    if sur.regularizer is not None:
        loss = loss + aggregate(sur.regularizer, mask, cfg.loss_agg, **agg)

    if cfg.entropy_coef != 0.0:
        if entropy is None:
            raise UserError("algorithm.entropy_coef is non-zero, which needs per-token entropies; "
                            "the trainer must pass `entropy`")
        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.loss_agg, **agg)

    if cfg.kl_in == "loss" and kl_coef > 0:
        if ref_logprobs is None:
            raise UserError("algorithm.kl_coef > 0 with kl_in: loss needs the reference model's logprobs "
                            "(ref_logprobs); the trainer must load the reference model")
        kl = kl_estimate(logprobs, ref_logprobs.detach(), cfg.kl_estimator, cfg.kl_k3_clamp)
        loss = loss + kl_coef * aggregate(kl, mask, cfg.loss_agg, **agg)
    if ref_logprobs is not None:
        stats.add_masked("actor/kl_ref", kl_estimate(logprobs.detach(), ref_logprobs.detach(), cfg.kl_estimator,
                                                      cfg.kl_k3_clamp), mask)

    _record_policy_stats(stats, sur, pg, pg_mask, mask, logprobs, old_logprobs, entropy)
    return LossOutput(loss=loss * world_size, stats=stats)


def _record_policy_stats(stats: Stats, sur: Surrogate, pg: Tensor, pg_mask: Tensor, mask: Tensor,
                         logprobs: Tensor, old_logprobs: Tensor, entropy: Tensor | None) -> None:
    stats.add_masked("actor/pg_loss", pg.detach(), pg_mask)
    stats.add_masked("actor/clipfrac_high", sur.clipped_high.float(), pg_mask)
    stats.add_masked("actor/clipfrac_low", sur.clipped_low.float(), pg_mask)
    stats.add_masked("actor/clipfrac", (sur.clipped_high | sur.clipped_low).float(), pg_mask)
    if sur.dual_clipped is not None:
        stats.add_masked("actor/dual_clipfrac", sur.dual_clipped.float(), pg_mask)
    for name, values in sur.metrics.items():
        stats.add_masked(name, values, mask)
    log_ratio = (logprobs.detach() - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    # k3 estimate of KL(pi_old || pi_theta) from tokens sampled by pi_old: rho - 1 - log rho >= 0
    stats.add_masked("actor/approx_kl_old_k3", ratio - 1.0 - log_ratio, mask)
    stats.add_masked("actor/ratio_mean", ratio, mask)
    stats.add_max("actor/ratio_max", ratio, mask)
    if entropy is not None:
        stats.add_masked("actor/entropy", entropy.detach(), mask)
    stats.add("actor/trained_token_frac", pg_mask.sum(), mask.sum())


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float, *,
               num_tokens: Tensor | float | None = None, world_size: int = 1) -> LossOutput:
    """Clipped value loss, token-mean: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2).

    `num_tokens` and `world_size` follow the same convention as `policy_loss` (module docstring).
    Multiply by `algorithm.value_coef` when adding it to a shared loss.
    """
    mask = mask.bool()
    values, old_values, returns = values.float(), old_values.detach().float(), returns.detach().float()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    plain, clipped = (values - returns).square(), (clipped_values - returns).square()
    per_token = 0.5 * torch.maximum(plain, clipped)
    loss = aggregate(per_token, mask, "token-mean", num_tokens=num_tokens)
    stats = Stats()
    stats.add_masked("critic/value_loss", per_token.detach(), mask)
    stats.add_masked("critic/value_clipfrac", (clipped.detach() > plain.detach()).float(), mask)
    stats.add_masked("critic/values_mean", values.detach(), mask)
    stats.add_masked("critic/returns_mean", returns, mask)
    return LossOutput(loss=loss * world_size, stats=stats)

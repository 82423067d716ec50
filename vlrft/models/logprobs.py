"""Per-token logprobs and entropy from hidden states, a chunk of tokens at a time.

Only completion tokens go through the LM head, and never all at once: a chunk holds at most
`max_chunk_elements` logits (so with a 152k-row head a chunk is ~110 tokens, with a 1k-row head
1024 tokens). When gradients are needed and the logits would not fit in one chunk, `_ChunkedHead`
keeps nothing per chunk: backward recomputes each chunk's logits, forms their gradient in closed
form and accumulates the head's weight gradient in place (one [vocab, hidden] buffer, as any
training step has, instead of one per chunk; under autocast a float32 one, fed bf16 products of
`HEAD_GRAD_BLOCK_ROWS` vocabulary rows at a time). Peak memory is therefore a few chunks of logits
plus the head's own gradient, whatever the number of tokens; a [tokens, vocab] float32 tensor
never exists whole, in forward or backward.

The entropy is summed as -sum p log p over log p = z - log_norm, terms of the entropy's own size.
`log_norm - sum p z` subtracts two numbers of the logits' size (trained heads give logits of
tens), and float32's rounding of `sum p z` over a 152k vocabulary left the entropy off by ~1e-3.

`truncation` (the rollout's top-k / top-p / min-p, `SamplingTruncation`) adds a third output: the log
of the probability mass those filters keep of each token's distribution. The engines report the
logprob of the truncated distribution they sampled from, log p(a) - that mass; truncated importance
sampling compares like with like through it (`vlrft.algo.losses.policy_loss`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vlrft.models.precision import active_autocast_dtype

# Float32 logits one chunk may hold (64 MiB): the chunk's token count is derived from it and the vocabulary.
LOGITS_CHUNK_ELEMENTS = 1 << 24
# Above this many logits in total, gradients go through `_ChunkedHead` (recomputed per chunk in backward).
CHECKPOINT_ABOVE_ELEMENTS = LOGITS_CHUNK_ELEMENTS
# Under autocast the head's gradient is formed this many vocabulary rows at a time (bf16 products, float32 sums).
HEAD_GRAD_BLOCK_ROWS = 16384


# The order in which each rollout engine applies its filters after the temperature (each filter acting on the
# distribution the previous ones left, renormalised):
# - hf: transformers' warpers as `vlrft.decoding.processors.sampling_warpers` applies them: top-k, top-p, min-p.
# - vllm (0.32, `vllm/v1/sample/sampler.py`): min-p (an argmax-invariant logits processor, run right after the
#   temperature), then top-k / top-p (`apply_top_k_top_p`: top-k, then top-p over what top-k kept).
# - sglang (`python/sglang/srt/layers/sampler.py`): top-k, top-p, then min-p, each renormalised (its flashinfer
#   backend with min-p). Without min-p it filters top-k and top-p jointly on the untruncated distribution, which
#   this table does not model; SGLang reports untruncated logprobs (docs/engines.md), so the trainer never asks
#   for its kept mass (`Trainer._sampling_truncation`).
# min-p keeps the most likely token and compares ratios to it, so it commutes with top-k / top-p whenever it runs
# last; it does not when it runs first: top-p then counts its cumulative mass over what min-p kept.
FILTER_ORDERS = {"hf": ("top_k", "top_p", "min_p"), "vllm": ("min_p", "top_k", "top_p"),
                 "vllm_server": ("min_p", "top_k", "top_p"),  # vLLM's own server: its sampler, as vllm
                 "sglang": ("top_k", "top_p", "min_p")}


@dataclass(frozen=True)
class SamplingTruncation:
    """The filters a rollout engine samples through (after the temperature), in `engine`'s order (`FILTER_ORDERS`):
    the kept mass must be the one the engine that sampled kept, and the orders differ (vLLM runs min-p first)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    engine: str = "hf"  # the rollout engine whose filter order applies (a key of FILTER_ORDERS)

    def __post_init__(self):
        if self.engine not in FILTER_ORDERS:
            raise ValueError(f"no filter order known for engine {self.engine!r}; known: {', '.join(FILTER_ORDERS)}")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def warpers(self) -> list:
        """transformers' warpers for the active filters, in `engine`'s order (each renormalises what it is given)."""
        from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        made = {"top_k": lambda: TopKLogitsWarper(top_k=self.top_k) if self.top_k > 0 else None,
                "top_p": lambda: TopPLogitsWarper(top_p=self.top_p) if self.top_p < 1.0 else None,
                "min_p": lambda: MinPLogitsWarper(min_p=self.min_p) if self.min_p > 0.0 else None}
        return [w for w in (made[name]() for name in FILTER_ORDERS[self.engine]) if w is not None]


def kept_log_mass(log_p: torch.Tensor, truncation: SamplingTruncation) -> torch.Tensor:
    """[N] log of the probability that `truncation`'s filters keep of each row of normalised log-probabilities
    `log_p` [N, V] (0 when nothing is filtered): the engine's truncated logprob of a kept token is log p - this."""
    kept = log_p
    for warper in truncation.warpers():
        kept = warper(None, kept)
    return torch.logsumexp(kept, dim=-1)


def chunk_tokens_for(vocab_size: int, chunk_tokens: int = 1024, max_chunk_elements: int = LOGITS_CHUNK_ELEMENTS) -> int:
    """Tokens per LM-head chunk: `chunk_tokens`, fewer when the vocabulary would exceed the element budget."""
    return max(1, min(chunk_tokens, max_chunk_elements // max(vocab_size, 1)))


def _in_compute_dtype(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias as autocast's matmuls read them (`dtype`: the active autocast's, or None), cast once
    for all chunks: with autocast's cast cache off (`vlrft.models.precision.forward_autocast`) each chunk's matmul
    would cast the whole [vocab, hidden] weight again."""
    if dtype is None or weight.dtype != torch.float32:
        return weight, bias
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           inv_temperature: float, suppressed: torch.Tensor | None, truncation: SamplingTruncation | None = None
           ) -> tuple[torch.Tensor, ...]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float() * inv_temperature
    if suppressed is not None:  # tokens the engines never sample are not part of the policy either
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # CPU log_softmax is off by ~3e-5 at 152k
    logprobs = log_p.gather(-1, targets[:, None]).squeeze(-1)
    kept = None
    if truncation is not None:
        with torch.no_grad():
            kept = kept_log_mass(log_p.detach(), truncation)
    probs = log_p.exp()
    if suppressed is not None:
        log_p = log_p.masked_fill(probs == 0, 0.0)  # 0 * -inf counts as 0
    entropy = -(probs * log_p).sum(-1)  # -sum p log p, not log_norm - sum p z: see the module's docstring
    return (logprobs, entropy) if kept is None else (logprobs, entropy, kept)


def _scaled_logits(hidden, weight, bias, inv_temperature, suppressed):
    """Float32 logits / temperature with suppressed tokens at -inf (no autograd: scaled and filled in place)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if inv_temperature != 1.0:
        logits.mul_(inv_temperature)
    if suppressed is not None:
        logits.index_fill_(-1, suppressed, float("-inf"))
    return logits


def _lean_chunk(hidden, weight, bias, targets, inv_temperature, suppressed, truncation=None):
    """`_chunk` without autograd, in place: about two [chunk, vocab] float32 tensors alive instead of five.
    Returns (logprobs, entropy, log_norm), and the kept log mass with a `truncation`."""
    z = _scaled_logits(hidden, weight, bias, inv_temperature, suppressed)
    log_norm = torch.logsumexp(z, dim=-1)
    log_p = z.sub_(log_norm[:, None])
    logprobs = log_p.gather(-1, targets[:, None]).squeeze(-1)
    kept = None if truncation is None else kept_log_mass(log_p, truncation)
    p = log_p.exp()
    if suppressed is not None:
        log_p.index_fill_(-1, suppressed, 0.0)  # p is 0 there; 0 * -inf would be nan
    entropy = -p.mul_(log_p).sum(-1)  # -sum p log p, not log_norm - sum p z: see the module's docstring
    return (logprobs, entropy, log_norm) if kept is None else (logprobs, entropy, log_norm, kept)


class _ChunkedHead(torch.autograd.Function):
    """logprobs and entropy of every token, chunk by chunk, saving only the inputs (and [N] norms) for backward.

    With z the scaled logits, p = softmax(z) and H the entropy: d logprob / dz = onehot(target) - p
    and dH / dz = -p * (log p + H) (0 where p is 0, i.e. suppressed tokens). Backward runs outside
    the forward's autocast (the trainer calls `backward()` after leaving it), so it re-enters it:
    the recomputed logits must be the forward's (bf16 matmul), or log p = z - log_norm no longer
    normalises, and the gradient matmuls run in bf16 as autograd's would. The head's gradient is
    accumulated over chunks in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temperature, suppressed, step, truncation=None):
        dtype = active_autocast_dtype(hidden.device)
        w, b = _in_compute_dtype(weight, bias, dtype)
        parts = [_lean_chunk(hidden[start:start + step], w, b, targets[start:start + step], inv_temperature,
                             suppressed, truncation) for start in range(0, hidden.shape[0], step)]
        del w, b
        logprobs, entropy, log_norm, *kept = (torch.cat(column) for column in zip(*parts))
        ctx.save_for_backward(hidden, weight, bias, targets, suppressed, log_norm, entropy)
        ctx.inv_temperature, ctx.step = inv_temperature, step
        ctx.autocast = (hidden.device.type, dtype) if dtype is not None else None
        ctx.mark_non_differentiable(*kept)
        return (logprobs, entropy, *kept)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_kept):
        hidden, weight, bias, targets, suppressed, log_norm, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias and bias is not None else None
        with torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext():
            w, b = _in_compute_dtype(weight, bias, ctx.autocast[1] if ctx.autocast else None)
            for start in range(0, hidden.shape[0], ctx.step):
                end = min(start + ctx.step, hidden.shape[0])
                h = hidden[start:end]
                log_p = _scaled_logits(h, w, b, ctx.inv_temperature, suppressed)
                log_p.sub_(log_norm[start:end, None])
                p = log_p.exp()
                if suppressed is not None:
                    log_p.index_fill_(-1, suppressed, 0.0)  # p is 0 there
                # grad_z = g_ent * (-p * (log p + H)) - g_lp * p + g_lp * onehot, built in place in log_p
                grad_z = log_p.add_(entropy[start:end, None]).mul_(p).mul_(-grad_entropy[start:end, None])
                grad_z.addcmul_(p, grad_logprobs[start:end, None], value=-1.0)
                del p
                grad_z.scatter_add_(1, targets[start:end, None], grad_logprobs[start:end, None])
                if suppressed is not None:
                    grad_z.index_fill_(-1, suppressed, 0.0)
                if ctx.inv_temperature != 1.0:
                    grad_z.mul_(ctx.inv_temperature)
                grad_z = grad_z.to(weight.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad_z @ w  # under autocast a bf16 matmul, as autograd's
                if grad_weight is not None and grad_weight.dtype == grad_z.dtype and ctx.autocast is None:
                    grad_weight.addmm_(grad_z.t(), h.to(weight.dtype))  # in place: no [vocab, hidden] temporary
                elif grad_weight is not None:
                    # in-place addmm_ is not autocast: bf16 products summed in float32, a block of vocabulary
                    # rows at a time (no whole [vocab, hidden] temporary)
                    h = h.to(weight.dtype)
                    for row in range(0, grad_z.shape[1], HEAD_GRAD_BLOCK_ROWS):
                        rows = slice(row, row + HEAD_GRAD_BLOCK_ROWS)
                        grad_weight[rows].add_(grad_z[:, rows].t() @ h)
                if grad_bias is not None:
                    grad_bias.add_(grad_z.sum(0))
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


def token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int = 1024, suppressed_ids: tuple[int, ...] = (),
                   max_chunk_elements: int = LOGITS_CHUNK_ELEMENTS, truncation: SamplingTruncation | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """logprob of `targets` [N] under softmax(lm_head(hidden [N, H]) / temperature), and the entropy, both [N].

    `chunk_tokens` caps the tokens per chunk and `max_chunk_elements` the logits per chunk (the
    smaller wins). `suppressed_ids` (tokens no engine may sample, e.g. vision placeholders) get
    probability zero, so the trainer's distribution is the one the rollouts were sampled from. With an
    active `truncation` a third [N] tensor (no gradient): `kept_log_mass` of each token's distribution.
    """
    truncation = truncation if truncation is not None and truncation.active else None
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (empty, empty) if truncation is None else (empty, empty, empty)
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    step = chunk_tokens_for(weight.shape[0], chunk_tokens, max_chunk_elements)
    # Keeping every chunk's logits for backward would cost tokens x vocab floats: above one chunk's
    # budget, backward recomputes them instead (_ChunkedHead).
    suppressed = torch.tensor(suppressed_ids, dtype=torch.long, device=hidden.device) if suppressed_ids else None
    if torch.is_grad_enabled() and hidden.shape[0] * weight.shape[0] > max_chunk_elements:
        return _ChunkedHead.apply(hidden, weight, bias, targets, inv_t, suppressed, step, truncation)
    grad = torch.is_grad_enabled()
    compute = _chunk if grad else _lean_chunk  # small enough to keep for autograd, or no grad
    weight, bias = _in_compute_dtype(weight, bias, active_autocast_dtype(hidden.device))  # a cast autograd follows
    logprobs, entropies, kept = [], [], []
    for start in range(0, hidden.shape[0], step):
        out = compute(hidden[start:start + step], weight, bias, targets[start:start + step], inv_t, suppressed,
                      truncation)
        logprobs.append(out[0])
        entropies.append(out[1])
        if truncation is not None:
            kept.append(out[-1])
    if truncation is None:
        return torch.cat(logprobs), torch.cat(entropies)
    return torch.cat(logprobs), torch.cat(entropies), torch.cat(kept)

"""Per-token logprobs and entropy from hidden states, a chunk of tokens at a time.

Only completion tokens go through the LM head, and never all at once: each chunk's logits live
only inside the chunk (recomputed in backward under activation checkpointing when they would be
large), so a 150k-token vocabulary never materialises a [batch, length, vocab] float32 tensor.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# Above this many logits per chunk (float32 elements) the chunk is checkpointed: its logits are
# recomputed in backward instead of being kept for it.
CHECKPOINT_ABOVE_ELEMENTS = 1 << 24


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           inv_temperature: float, suppressed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float() * inv_temperature
    if suppressed is not None:  # tokens the engines never sample are not part of the policy either
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    probs = torch.softmax(logits, dim=-1)
    entropy = log_norm - (probs * logits.masked_fill(probs == 0, 0.0)).sum(-1)  # 0 * -inf counts as 0
    return logprobs, entropy


def token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_tokens: int = 1024, suppressed_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of `targets` [N] under softmax(lm_head(hidden [N, H]) / temperature), and the entropy, both [N].

    `suppressed_ids` (tokens no engine may sample, e.g. vision placeholders) get probability zero,
    so the trainer's distribution is the one the rollouts were sampled from.
    """
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    use_ckpt = torch.is_grad_enabled() and chunk_tokens * weight.shape[0] > CHECKPOINT_ABOVE_ELEMENTS
    suppressed = torch.tensor(suppressed_ids, dtype=torch.long, device=hidden.device) if suppressed_ids else None
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if use_ckpt:
            lp, ent = checkpoint(_chunk, h, weight, bias, t, inv_t, suppressed, use_reentrant=False)
        else:
            lp, ent = _chunk(h, weight, bias, t, inv_t, suppressed)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)

"""The lean decode step for Qwen2/Llama-layout text decoders (Qwen2/2.5/3-VL; InternVL 3, LLaVA-OneVision: Qwen2;
SmolVLM: Llama): transformers' layers' arithmetic, about half the ops.

What it keeps and why (the op counts, the attention branches, the rounding under autocast): docs/decoding.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlrft.decoding.lean_weights import LayerWeights, packing_applies, rms_norm, written_in
from vlrft.decoding.shared_prompt import SharedPrompt
from vlrft.models.precision import active_autocast_dtype


class LeanDecoder:
    """Decode steps for `rows` rows continuing prompts of `prompt_len` (left-padded) positions.

    Built from the prefill's KV cache, one row per prompt; `rows` picks each decoded row's prompt, `prompt_mask`
    and `last_position` are per decoded row. `mrope`: the rotary module takes M-RoPE's [3, B, L] positions (decoded
    tokens are text, equal on the three axes), else 1-D [B, L] ones. `step` returns the final-norm hidden state of
    each row's new token.
    A layer's cache [rows, kv_heads, length, head_dim] is read as [rows * kv_heads, ...], a KV head's query heads
    as the rows of one `baddbmm` (GQA without repeating the cache); under autocast through SDPA (`_sdpa`).
    """

    def __init__(self, text_model: nn.Module, prefill_cache, rows: torch.Tensor, prompt_mask: torch.Tensor,
                 last_position: torch.Tensor, max_new_tokens: int, fixed_shapes: bool = False,
                 share_prompt: bool = False, mrope: bool = True):
        self.model = text_model
        self.fixed_shapes = fixed_shapes
        # Under autocast: the dtype of its matmuls, in which the projections and the KV cache are kept.
        self.compute_dtype = active_autocast_dtype(text_model.embed_tokens.weight.device)
        pack = self.compute_dtype is None and packing_applies(text_model.embed_tokens.weight)
        self.layers = [LayerWeights.of(layer, len(rows), pack, self.compute_dtype) for layer in text_model.layers]
        first = text_model.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.prompt_len = prompt_mask.shape[1]
        device = prompt_mask.device
        self.shared: SharedPrompt | None = None
        if share_prompt:
            self.shared = SharedPrompt.of(prefill_cache, rows, prompt_mask, self.compute_dtype)
        # The per-row buffers: with a shared prompt the generated positions only, else the prompt's (copied) too.
        self.offset = 0 if self.shared else self.prompt_len  # where the generated positions start in them
        length = self.offset + max_new_tokens
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for index in range(len(self.layers)):
            keys, values = prefill_cache.layers[index].keys, prefill_cache.layers[index].values
            # With fixed shapes the attention reads positions not yet written: zeros there (masked, but 0 x NaN from
            # uninitialised memory would still be NaN); otherwise a step reads only what has been written.
            new = torch.zeros if fixed_shapes else torch.empty
            k_buffer = new(len(rows), keys.shape[1], length, keys.shape[3], dtype=self.compute_dtype or keys.dtype,
                           device=keys.device)
            v_buffer = new(len(rows), values.shape[1], length, values.shape[3],
                           dtype=self.compute_dtype or values.dtype, device=values.device)
            if not self.shared:
                k_buffer[:, :, :self.prompt_len] = keys[rows, :, :self.prompt_len]
                v_buffer[:, :, :self.prompt_len] = values[rows, :, :self.prompt_len]
            self.keys.append(k_buffer)
            self.values.append(v_buffer)
        self.kv_heads = self.keys[0].shape[1]
        dtype = self.keys[0].dtype
        bias = torch.full((len(rows), self.kv_heads, 1, length), float("-inf"), dtype=dtype, device=device)
        if not self.shared:
            bias[..., :self.prompt_len].masked_fill_(prompt_mask.bool()[:, None, None, :], 0.0)
        self.mask_bias = bias  # [rows, kv_heads, 1, length]: 0 where a row may attend, -inf elsewhere
        self.position = last_position.clone()  # [rows]: the last position each row has seen
        self.slot = torch.full((1,), self.offset - 1, dtype=torch.long, device=device)  # the last written
        table = torch.arange(int(last_position.max()) + max_new_tokens + 1, device=device)
        # in the hidden states' dtype, as transformers' layers take it (under autocast float32, not the cache's)
        probe = text_model.embed_tokens.weight.new_empty(1, 1, self.head_dim)
        cos, sin = text_model.rotary_emb(probe, table.view(1, 1, -1).expand(3, 1, -1) if mrope else table.view(1, -1))
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin[:half], sin[half:]]: the sign folded into the table
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # [positions, head_dim]
        self.embed = text_model.embed_tokens.weight

    def keep(self, index: torch.Tensor) -> None:
        """Drop every row not in `index` (rows that stopped)."""
        if self.fixed_shapes:
            raise RuntimeError("a fixed-shape LeanDecoder keeps every row; wrap it in vlrft.decoding.graph."
                               "FixedRowsDecoder, whose keep() only stops reporting rows")
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.mask_bias = self.mask_bias.index_select(0, index)
        self.position = self.position.index_select(0, index)
        if self.shared:
            self.shared.keep(index)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' apply_rotary_pos_emb for one tensor [rows, heads, head_dim]. Under autocast the sum is
        written in the compute dtype by its own kernel: the cast the attention (and the cache) would make."""
        return written_in(self.compute_dtype, torch.add, x * cos, torch.roll(x, self.head_dim // 2, dims=-1) * sin)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of one query per row as transformers' SDPA layers call it for one new token: a KV head's query
        heads folded into the query length ([rows, kv_heads, heads per kv head, dim]), so neither the KV cache is
        repeated nor `enable_gqa` taken (with a mask CUDA would fall back to the math kernel). [rows, heads * dim]."""
        rows, kv_heads, length = q.shape[0], keys.shape[1], keys.shape[2]
        mask = self.mask_bias[:, :1, :, :length]  # [rows, 1, 1, length], the same for every head
        grouped = q.view(rows, kv_heads, -1, q.shape[-1])
        return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scaling).view(rows, -1)

    def state(self) -> tuple[torch.Tensor, ...]:
        """Copies of what a step advances besides the KV cache (for `restore`)."""
        return self.slot.clone(), self.position.clone(), self.mask_bias.clone()

    def restore(self, state: tuple[torch.Tensor, ...]) -> None:
        """Undo steps since `state()`, in place. The KV entries they wrote stay, masked, until overwritten."""
        for tensor, saved in zip((self.slot, self.position, self.mask_bias), state):
            tensor.copy_(saved)

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed `tokens` [rows] as generated token number `step` (0-based); the new hidden states [rows, hidden].

        The slot written, the positions and the mask advance as tensors, in place. With `fixed_shapes`
        every step attends over all preallocated positions (those not reached are masked) and `step`
        is not read: the same kernels on the same shapes each time, which a CUDA graph can replay.
        """
        rows, kv_heads, dim = tokens.shape[0], self.kv_heads, self.head_dim
        length = self.mask_bias.shape[-1] if self.fixed_shapes else self.offset + step + 1
        self.slot += 1
        self.position += 1
        self.mask_bias.index_fill_(-1, self.slot, 0.0)
        cos = self.cos.index_select(0, self.position).unsqueeze(1)  # [rows, 1, head_dim]
        sin = self.sin.index_select(0, self.position).unsqueeze(1)
        bias = self.mask_bias.view(rows * kv_heads, 1, -1)[..., :length]
        hidden = F.embedding(tokens, self.embed)  # [rows, hidden]
        for index, (weights, k_cache, v_cache) in enumerate(zip(self.layers, self.keys, self.values)):
            x = rms_norm(hidden, weights.norm1, out_dtype=self.compute_dtype)
            qk, v = weights.qkv(x)
            qk, v = qk.view(rows, -1, dim), v.view(rows, kv_heads, dim)  # q's heads then k's: normed, rotated as one
            if weights.qk_norm is not None:
                qk = rms_norm(qk, *weights.qk_norm)
            qk = self._rotate(qk, cos, sin)
            q, k = qk[:, :-kv_heads], qk[:, -kv_heads:]
            k_cache.index_copy_(2, self.slot, k.to(k_cache.dtype).unsqueeze(2))
            v_cache.index_copy_(2, self.slot, v.to(v_cache.dtype).unsqueeze(2))
            if self.shared:
                attended = self.shared.attend(index, q, k_cache.view(rows * kv_heads, -1, dim)[:, :length],
                                              v_cache.view(rows * kv_heads, -1, dim)[:, :length], bias, self.scaling)
            elif self.compute_dtype is not None:
                attended = self._sdpa(q, k_cache[:, :, :length], v_cache[:, :, :length])
            else:
                keys = k_cache.view(rows * kv_heads, -1, dim)[:, :length]
                values = v_cache.view(rows * kv_heads, -1, dim)[:, :length]
                grouped = q.reshape(rows * kv_heads, -1, dim)  # a KV head's query heads as rows
                scores = torch.baddbmm(bias, grouped, keys.transpose(1, 2), alpha=self.scaling)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                attended = torch.bmm(probs, values).view(rows, -1)
            [hidden] = weights.o(attended, residual=hidden)
            gate, up = weights.gate_up(rms_norm(hidden, weights.norm2, out_dtype=self.compute_dtype))
            [hidden] = weights.down(F.silu(gate) * up, residual=hidden)
        return rms_norm(hidden, self.model.norm)

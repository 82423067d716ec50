"""A lean decode step for Qwen-family text decoders: the same arithmetic as transformers' layers, fewer ops.

A decode step feeds one token per row through the text decoder. Through transformers' modules that
is about a thousand dispatched ops per step on a small model (module calls, cache objects, mask
and rotary bookkeeping, output records), which on CPU costs more than the matmuls themselves. Here
a step is the layers' arithmetic and nothing else: the model's own weights read in place (never
copied, so no weight sync is needed), a KV cache preallocated for prompt + max_new_tokens positions
and written in place, the attention mask kept as one boolean buffer, and the rotary cos/sin taken
from a table the model's own rotary module computed once (decoded tokens are text, whose M-RoPE
positions are equal on all three axes, so the table is indexed by one position per row).

Only architectures whose layers are known to be exactly this arithmetic are taken (`UNSUPPORTED`
explains why another is not); anything else, an adapter-wrapped projection (LoRA), sharded
parameters or a sliding window, decodes through transformers (`decode_groups` falls back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Text decoders whose layer is: RMSNorm -> q/k/v (optional bias; Qwen3: RMSNorm on each head) -> rotary ->
# attention -> o_proj -> residual -> RMSNorm -> SiLU-gated MLP -> residual; final RMSNorm.
SUPPORTED_TEXT_MODELS = ("Qwen2VLTextModel", "Qwen2_5_VLTextModel", "Qwen3VLTextModel")


def unsupported_reason(text_model: nn.Module) -> str | None:
    """Why `text_model` cannot use the lean step (None: it can)."""
    name = type(text_model).__name__
    if name not in SUPPORTED_TEXT_MODELS:
        return f"{name} is not one of {', '.join(SUPPORTED_TEXT_MODELS)}"
    config = text_model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "the model has sliding-window layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act is {config.hidden_act}, not silu"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation} (lean decoding uses SDPA)"
    for layer in text_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(linear) is not nn.Linear:
                return f"a projection is a {type(linear).__name__} (e.g. a LoRA adapter), not a plain Linear"
    for parameter in text_model.parameters():
        if type(parameter.data) is not torch.Tensor:  # DTensor (FSDP2 shard) or another tensor subclass
            return f"parameters are {type(parameter.data).__name__}, not whole tensors"
    return None


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Qwen RMSNorm: normalised in float32, cast back, then scaled by the weight."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    """Decode steps for `rows` rows continuing prompts of `prompt_len` (left-padded) positions.

    Built from the prefill's KV cache, one row per prompt; `rows` picks each decoded row's prompt
    (repeated for the group), `prompt_mask` and `last_position` are per decoded row. `step` returns the
    final-norm hidden state of each row's new token, like the text model's last_hidden_state[:, -1].
    """

    def __init__(self, text_model: nn.Module, prefill_cache, rows: torch.Tensor, prompt_mask: torch.Tensor,
                 last_position: torch.Tensor, max_new_tokens: int):
        self.model = text_model
        self.layers = list(text_model.layers)
        first = self.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.prompt_len = prompt_mask.shape[1]
        length = self.prompt_len + max_new_tokens
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for index in range(len(self.layers)):
            keys, values = prefill_cache.layers[index].keys, prefill_cache.layers[index].values
            k_buffer = keys.new_empty(len(rows), keys.shape[1], length, keys.shape[3])
            v_buffer = values.new_empty(len(rows), values.shape[1], length, values.shape[3])
            k_buffer[:, :, :self.prompt_len] = keys[rows, :, :self.prompt_len]
            v_buffer[:, :, :self.prompt_len] = values[rows, :, :self.prompt_len]
            self.keys.append(k_buffer)
            self.values.append(v_buffer)
        self.mask = torch.zeros(len(rows), 1, 1, length, dtype=torch.bool, device=prompt_mask.device)
        self.mask[:, 0, 0, :self.prompt_len] = prompt_mask.bool()
        self.position = last_position.clone()  # [rows]: the last position each row has seen
        table = torch.arange(int(last_position.max()) + max_new_tokens + 1, device=prompt_mask.device)
        probe = self.keys[0].new_empty(1, 1, self.head_dim)
        cos, sin = text_model.rotary_emb(probe, table.view(1, 1, -1).expand(3, 1, -1))
        self.cos, self.sin = cos[0], sin[0]  # [positions, head_dim]
        self.embed = text_model.embed_tokens.weight

    def keep(self, index: torch.Tensor) -> None:
        """Drop every row not in `index` (rows that stopped)."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.mask = self.mask.index_select(0, index)
        self.position = self.position.index_select(0, index)

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed `tokens` [rows] as generated token number `step` (0-based); the new hidden states [rows, hidden]."""
        slot = self.prompt_len + step
        self.position += 1
        self.mask[:, 0, 0, slot] = True
        cos = self.cos.index_select(0, self.position).unsqueeze(1).unsqueeze(1)  # [rows, 1, 1, head_dim]
        sin = self.sin.index_select(0, self.position).unsqueeze(1).unsqueeze(1)
        mask = self.mask[..., :slot + 1]
        rows = tokens.shape[0]  # rows still running
        hidden = F.embedding(tokens, self.embed)  # [rows, hidden]
        for layer, k_cache, v_cache in zip(self.layers, self.keys, self.values):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(hidden, layer.input_layernorm)
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(rows, -1, 1, self.head_dim)
            k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(rows, -1, 1, self.head_dim)
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(rows, -1, 1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary
                q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache[:, :, slot:slot + 1] = k
            v_cache[:, :, slot:slot + 1] = v
            out = self._attend(q, k_cache[:, :, :slot + 1], v_cache[:, :, :slot + 1], mask)
            hidden = hidden + F.linear(out.reshape(rows, -1), attn.o_proj.weight, attn.o_proj.bias)
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            gated = F.silu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)) * F.linear(x, mlp.up_proj.weight,
                                                                                          mlp.up_proj.bias)
            hidden = hidden + F.linear(gated, mlp.down_proj.weight, mlp.down_proj.bias)
        return _rms_norm(hidden, self.model.norm)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of one query per row over its cached keys: [rows, heads, 1, head_dim].

        On CUDA through SDPA's kernels. On CPU SDPA's flash kernel costs ~0.4 ms per call for a
        single query (more than the step's matmuls), so there it is two batched matmuls and a
        softmax, with the query heads of each KV head stacked (GQA without repeating the cache).
        """
        if q.is_cuda:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=q.shape[1] != keys.shape[1])
        rows, heads, _, dim = q.shape
        kv_heads = keys.shape[1]
        grouped = q.view(rows, kv_heads, heads // kv_heads, dim)  # a KV head's query heads as rows of one matmul
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(self.scaling)
        scores.masked_fill_(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, values).view(rows, heads, 1, dim)

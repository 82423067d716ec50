"""Decode steps through transformers' own layers: any model the lean step does not take (GLM-4.1V, DoRA, shards)."""

from __future__ import annotations

import torch

from vlrft.models.prompt_cache import cache_argument


def text_model_of(backbone):
    """The text decoder inside a VLM backbone (`language_model`; SmolVLM's `text_model`), or None."""
    for name in ("language_model", "text_model"):
        module = getattr(backbone, name, None)
        if module is not None:
            return module
    return None


def has_sliding_window(module) -> bool:
    """Whether a text decoder (or a backbone's text config) has sliding-window attention layers (Gemma 3)."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return "sliding_attention" in (getattr(config, "layer_types", None) or ())


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep only `index` rows of a KV cache (static layers have no batch_select_indices of their own)."""
    from transformers import StaticCache

    if not isinstance(cache, StaticCache):
        cache.batch_select_indices(index)
        return
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
            layer.batch_size = len(index)


class TransformersDecoder:
    """Decode steps through transformers' layers (any model): holds the group's KV cache, the attention mask buffer
    and the rows' positions (M-RoPE's three axes, or one for 1-D positions)."""

    def __init__(self, backbone, cache, rows: torch.Tensor, prompt_mask: torch.Tensor, position: torch.Tensor,
                 max_new_tokens: int, mm_dtype: torch.dtype, static_cache: bool):
        self.backbone = backbone
        # A decode step carries no image or video: the multimodal wrapper would only embed the ids and
        # pass them on, so the text decoder is called directly (same modules, one wrapper less per token).
        self.text_model = text_model_of(backbone)
        self.cache, self.static_cache = cache, static_cache
        select_rows(cache, rows)
        self.prompt_len = prompt_mask.shape[1]
        # With a static cache the model attends over every preallocated position (future ones masked);
        # a dynamic one holds exactly the positions so far.
        self.attention = step_mask_buffer(backbone, prompt_mask, self.prompt_len + max_new_tokens)
        self.position = position  # [axes, rows]: the last position; each new token adds 1 on every axis
        self.one_d = position.shape[0] == 1  # a 1-D model takes [rows, 1] positions
        self.mm = torch.zeros(len(rows), 1, dtype=mm_dtype, device=position.device)

    def keep(self, index: torch.Tensor) -> None:
        """Drop every row not in `index` (rows that stopped)."""
        select_rows(self.cache, index)
        self.attention, self.position, self.mm = self.attention[index], self.position[:, index], self.mm[:len(index)]

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed `tokens` [rows] as generated token number `step` (0-based); the new hidden states [rows, hidden]."""
        self.position += 1  # as vlrft.models.positions.positions_after places them
        self.attention[..., self.prompt_len + step] = True
        mask = self.attention if self.static_cache else self.attention[..., :self.prompt_len + step + 1]
        position = self.position[0, :, None] if self.one_d else self.position[:, :, None]
        return self._forward(tokens[:, None], mask, position, self.mm, self.cache)

    def _forward(self, tokens, attention, position, mm, cache):
        if self.text_model is not None:
            out = self.text_model(input_ids=tokens, attention_mask=attention, position_ids=position,
                                  use_cache=True, **cache_argument(self.text_model, cache))
        else:
            out = self.backbone(input_ids=tokens, attention_mask=attention, position_ids=position,
                                use_cache=True, mm_token_type_ids=mm, **cache_argument(self.backbone, cache))
        return out.last_hidden_state[:, -1]


def step_mask_buffer(backbone, prompt_mask: torch.Tensor, length: int) -> torch.Tensor:
    """The decode steps' attention mask over `length` positions, the prompt's filled in.

    With SDPA it is kept in the boolean [rows, 1, 1, length] form the attention layers take, which
    transformers passes through as it is, so no mask is built at each step (the same values it
    would build). Other kernels (eager's additive mask, flash-attention's padding mask) and models with sliding-window
    layers (Gemma 3: a sliding layer's cache holds its window only, its mask is built to that) get the 2D padding mask
    and build their own.
    """
    rows, prompt_len = prompt_mask.shape
    text_model = text_model_of(backbone) or backbone
    config = getattr(text_model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and not has_sliding_window(text_model):
        buffer = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=prompt_mask.device)
        buffer[:, 0, 0, :prompt_len] = prompt_mask.bool()
        return buffer
    buffer = torch.zeros(rows, length, dtype=prompt_mask.dtype, device=prompt_mask.device)
    buffer[:, :prompt_len] = prompt_mask
    return buffer

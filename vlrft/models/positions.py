"""M-RoPE positions of a prompt and of the tokens after it, in one place for the trainer and the rollouts.

The trainer's shared-prompt forward (`ActorVL`) and the rollout group decoder (`vlrft.decoding`)
both run a prompt once and continue it from its KV cache; both must place the continuation exactly
where a full forward would, or the logprobs of rollout and training differ.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch import nn


def prompt_positions(backbone: nn.Module, ids: torch.Tensor, mask: torch.Tensor, mm: torch.Tensor,
                     visual: dict) -> torch.Tensor:
    """[3, B, P] M-RoPE positions of left-padded prompts, by the model's own rule (`get_rope_index`).

    Text-only prompts use the plain cumulative position on all three axes.
    """
    if "image_grid_thw" in visual or "video_grid_thw" in visual:
        accepted = inspect.signature(backbone.get_rope_index).parameters
        extra = {k: v for k, v in visual.items() if k in accepted and k not in ("input_ids", "attention_mask")}
        positions, _ = backbone.get_rope_index(input_ids=ids, mm_token_type_ids=mm, attention_mask=mask, **extra)
        return positions
    text = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return text[None].expand(3, -1, -1)


def positions_after(prompt_positions: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[3, len(rows), len(steps)] positions of the tokens `steps` (1 = the first) after each row's prompt.

    Tokens after a prompt are text: they continue at the prompt's last position + 1, + 2, ... on all
    three M-RoPE axes. `rows` picks each row's prompt in `prompt_positions` [3, prompts, P].
    """
    return prompt_positions[:, rows, -1:] + steps


def has_rope_index(backbone: nn.Module) -> bool:
    """Whether the model exposes its M-RoPE rule, which placing tokens after a cached prompt needs."""
    return hasattr(backbone, "get_rope_index")


def follow_released_rope_rule(model: nn.Module) -> None:
    """Make `model`'s M-RoPE rule (its backbone's `get_rope_index`, which transformers' forward, `generate` and
    `prompt_positions` all call) place text after an image or video as the released Qwen-VL checkpoints were trained.

    Qwen's rule (Qwen2-VL / Qwen2.5-VL / Qwen3-VL reference code, and vLLM's `MRotaryEmbedding`): the text
    after a vision block starts at the block's largest position on any axis + 1. transformers 5 starts it at
    the block's start + max(h, w) / merge, which ignores the temporal axis: for a video whose (scaled)
    temporal extent exceeds its spatial one (Qwen2.5-VL: more than one temporal patch; Qwen2-VL: more
    frames than rows or columns) every later token, completions included, sat at another position than
    in vLLM. Images and short videos are unchanged. Idempotent; models without `get_rope_index` are left as
    they are.
    """
    for module in model.modules():
        rule = getattr(type(module), "get_rope_index", None)
        if rule is not None and not isinstance(module.__dict__.get("get_rope_index"), types.MethodType):
            # A bound method of the module itself: a deep copy of the model (LoRA merges, references) rebinds it.
            module.get_rope_index = types.MethodType(_released_rule(rule), module)


def _released_rule(get_rope_index):
    """transformers' `get_rope_index` (the class's function), then each block after a vision block restarted."""
    signature = inspect.signature(get_rope_index)

    @functools.wraps(get_rope_index)
    def rope_index(self, *args, **kwargs):
        positions, deltas = get_rope_index(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        types_, mask = bound.get("mm_token_type_ids"), bound.get("attention_mask")
        if types_ is None:
            return positions, deltas
        return restart_text_after_vision(positions, types_, mask)

    return rope_index


def restart_text_after_vision(positions: torch.Tensor, types: torch.Tensor, mask: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`positions` [3, B, L] (transformers' rule) with each block after a vision block moved to start at that
    vision block's largest position + 1; and the rope deltas (largest position + 1 - length, per row) [B, 1].

    `types` [B, L]: 0 text, else the vision kind (the processor's `mm_token_type_ids`); `mask`: 1 on real
    tokens. A block's own layout (its h/w grid, its temporal steps, text's +1 per token) is kept, so the
    correction is one shift per block: where transformers started block k+1 (its first token's position,
    equal on the three axes for text and at a vision block's first patch) against where the rule starts it.
    """
    out = positions.clone()
    deltas = []
    for row in range(positions.shape[1]):
        keep = mask[row].bool() if mask is not None else torch.ones_like(types[row], dtype=torch.bool)
        index = keep.nonzero()[:, 0]
        kinds = types[row, index].tolist()
        shift = 0
        start = 0
        while start < len(kinds):
            end = start + 1
            while end < len(kinds) and kinds[end] == kinds[start]:
                end += 1
            block = index[start:end]
            out[:, row, block] = positions[:, row, block] + shift
            if kinds[start] != 0 and end < len(kinds):  # the next block starts past this vision block's largest
                shift = int(out[:, row, block].max()) + 1 - int(positions[0, row, index[end]])
            start = end
        largest = int(out[:, row, index].max()) if len(index) else -1
        deltas.append(largest + 1 - len(index))
    return out, torch.tensor(deltas, device=positions.device, dtype=positions.dtype).unsqueeze(1)

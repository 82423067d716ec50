"""M-RoPE positions of a prompt and of the tokens after it, in one place for the trainer and the rollouts.

The trainer's shared-prompt forward (`ActorVL`) and the rollout group decoder (`vlrft.rollout.decode`)
both run a prompt once and continue it from its KV cache; both must place the continuation exactly
where a full forward would, or the logprobs of rollout and training differ.
"""

from __future__ import annotations

import inspect

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

"""The prefill: each distinct prompt through the backbone once, in groups under a token and a mask budget."""

from __future__ import annotations

import torch

from vlrft.decoding.transformers_layers import has_sliding_window, text_model_of
from vlrft.models.prompt_cache import cache_argument
from vlrft.sampling import PREFILL_MASK_ELEMENTS, PREFILL_TOKENS
from vlrft.vision import VisualBatch, token_type_kwargs


def prefill_groups(mask: torch.Tensor) -> list[torch.Tensor]:
    """The prompts (rows of the left-padded `mask`) to prefill together, longest first: all in one call, unless that
    call would run more than PREFILL_TOKENS padded tokens, or prompts of different lengths whose attention mask would
    reach PREFILL_MASK_ELEMENTS (such a group keeps to one length: unpadded, its attention needs no mask)."""
    prompts = mask.shape[0]
    lengths = mask.sum(dim=1).tolist()
    groups: list[list[int]] = []
    for prompt in sorted(range(prompts), key=lambda i: -lengths[i]):
        group = groups[-1] if groups else []
        width = lengths[group[0]] if group else lengths[prompt]  # the group's longest: its first
        ragged = bool(group) and lengths[prompt] != width
        count = len(group) + 1
        if group and (count * width > PREFILL_TOKENS or (ragged and count * width * width >= PREFILL_MASK_ELEMENTS)):
            group = []
        if not group:
            groups.append(group)
        group.append(prompt)
    if len(groups) == 1:
        return [torch.arange(prompts, device=mask.device)]
    return [torch.tensor(sorted(group), device=mask.device) for group in groups]


def prefill(backbone, ids: torch.Tensor, mask: torch.Tensor, mm: torch.Tensor, positions: torch.Tensor,
             visual: VisualBatch, cache, groups: list[torch.Tensor]):
    """The prompts through the backbone: (each prompt's last hidden state [prompts, hidden], its KV cache).

    One padded call, or one call per group of `groups`, padded to the group's longest prompt, whose caches are then
    merged into one left-padded dynamic cache (a group's layer at a time); the decode steps' masks never attend to
    the padding. `positions` [axes, prompts, P]: M-RoPE's three axes, or one (1-D positions, passed as [B, P]);
    the token types go by the name the backbone takes (Gemma 3's `token_type_ids`: bidirectional attention within
    each image in this prefill, causal decode steps after it).
    """
    def run(index, n: int, cache, visual_inputs: dict):
        place = positions[:, index, -n:]
        return backbone(input_ids=ids[index, -n:], attention_mask=mask[index, -n:],
                        position_ids=place if place.shape[0] == 3 else place[0], use_cache=True,
                        **token_type_kwargs(backbone, mm[index, -n:]), **cache_argument(backbone, cache),
                        **visual_inputs)

    length = ids.shape[1]
    if len(groups) == 1:
        out = run(slice(None), length, cache, visual.model_inputs())
        return out.last_hidden_state[:, -1].clone(), out.past_key_values  # not a view holding every position
    from transformers import DynamicCache

    last = None
    parts: list[tuple[torch.Tensor, list]] = []  # (prompts, per layer (keys, values))
    for index in groups:
        n = int(mask[index].sum(dim=1).max())  # the group's longest prompt
        out = run(index, n, None, visual.select(index.tolist()).model_inputs())
        hidden = out.last_hidden_state[:, -1]
        if last is None:
            last = hidden.new_empty(ids.shape[0], hidden.shape[-1])
        last[index] = hidden
        hidden = None  # a view: it would keep the group's every position alive through the merge
        parts.append((index, [[layer.keys, layer.values] for layer in out.past_key_values.layers]))
        out = None
    # A sliding-window layer (Gemma 3) keeps its last window - 1 positions: its groups' caches are right-aligned in the
    # prompt-length buffer as the others are, and the merged cache's sliding layer keeps the window of that again.
    text_model = text_model_of(backbone)
    merged = DynamicCache(config=text_model.config) if has_sliding_window(text_model) else DynamicCache()
    for layer in range(len(parts[0][1])):
        padded = []
        for which in (0, 1):  # keys, values
            first = parts[0][1][layer][which]
            buffer = first.new_zeros(ids.shape[0], first.shape[1], length, first.shape[3])
            for index, layers in parts:
                tensor = layers[layer][which]
                buffer[index, :, length - tensor.shape[2]:] = tensor
                layers[layer][which] = None  # the group's copy goes as soon as it is merged
            padded.append(buffer)
        merged.update(*padded, layer)
    return last, merged

"""M-RoPE positions follow the released Qwen-VL rule (text after a vision block starts at the block's largest
position + 1), which vLLM also applies; transformers 5 alone starts it at max(h, w) / merge past the block's start.

The expected positions are written here from the rule, not taken from transformers or from our code; vLLM's own
positions are compared in tests/test_vllm_executed.py (logprobs after a multi-patch video equal vLLM's)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.models.positions import follow_released_rope_rule


def frames(count: int, size: int) -> list[Image.Image]:
    rng = np.random.default_rng(count)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def rope_inputs(processor, samples):
    batch = PromptEncoder(processor, DataConfig(max_prompt_length=2048, video_fps=2.0)).encode(samples).batch
    width = max(len(ids) for ids in batch.prompt_ids)
    ids = torch.tensor([[0] * (width - len(i)) + list(i) for i in batch.prompt_ids])  # left padded
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in batch.prompt_ids])
    types = torch.tensor(processor.create_mm_token_type_ids(ids.tolist())) * mask
    return batch, ids, mask, types


def expected_by_the_rule(positions: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rebuilds each row's positions block by block: a text block continues at the previous block's largest position
    + 1, one step per token on all axes; a vision block keeps transformers' layout relative to its first patch."""
    out = torch.zeros_like(positions)
    for row in range(positions.shape[1]):
        index = mask[row].nonzero()[:, 0]
        kinds = types[row, index].tolist()
        following = 0  # where the next block starts
        start = 0
        while start < len(kinds):
            end = start + 1
            while end < len(kinds) and kinds[end] == kinds[start]:
                end += 1
            block = index[start:end]
            if kinds[start] == 0:
                out[:, row, block] = following + torch.arange(len(block))
            else:  # the block's own grid, moved to start at `following`
                out[:, row, block] = positions[:, row, block] - positions[0, row, block[0]] + following
            following = int(out[:, row, block].max()) + 1
            start = end
    return out


@pytest.mark.parametrize("arch,count,size", [("qwen2_5_vl", 8, 56), ("qwen2_vl", 16, 28)],
                         ids=["qwen2.5-vl-4-temporal-patches", "qwen2-vl-longer-in-time-than-space"])
def test_text_after_a_long_video_starts_past_the_videos_largest_position(arch, count, size, tiny_vlm_dir):
    from vlrft.models.loading import load_policy, load_processor

    folder = tiny_vlm_dir(arch)
    processor, model = load_processor(folder), load_policy(folder)
    samples = [Sample("video", "<video>What happens? Answer.", videos=[frames(count, size)]),
               Sample("image", "Look: <image> and say.", images=frames(1, 56)),
               Sample("text", "Only words here.")]
    batch, ids, mask, types = rope_inputs(processor, samples)
    visual = {k: v for k, v in batch.visual.model_inputs().items() if k != "pixel_values" and "pixel" not in k}
    before, _ = model.model.get_rope_index(ids, mm_token_type_ids=types, attention_mask=mask, **visual)
    follow_released_rope_rule(model)
    follow_released_rope_rule(model)  # idempotent
    after, deltas = model.model.get_rope_index(ids, mm_token_type_ids=types, attention_mask=mask, **visual)
    want = expected_by_the_rule(before, types, mask)
    assert torch.equal(after[:, mask.bool()], want[:, mask.bool()])
    assert not torch.equal(after[:, 0], before[:, 0])  # the video row moved: transformers' rule differs there
    assert torch.equal(after[:, 1:], before[:, 1:])  # images and text alone: the same rule
    lengths = mask.sum(1)
    assert deltas[:, 0].tolist() == [int(after[:, r, mask[r].bool()].max()) + 1 - int(lengths[r]) for r in range(3)]
    copied = copy.deepcopy(model)  # a deep copy (reference model, LoRA merge) keeps the rule, bound to itself
    assert copied.model.get_rope_index.__self__ is copied.model
    again, _ = copied.model.get_rope_index(ids, mm_token_type_ids=types, attention_mask=mask, **visual)
    assert torch.equal(again, after)

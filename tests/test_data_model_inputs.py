"""PromptBatch -> model forward: left-padded ids + mm_token_type_ids + VisualBatch.model_inputs() give a tiny
Qwen-VL model the same next-token logits as running each prompt alone, also after select (group repeats)."""

import pytest
import torch

from _data_helpers import noise_image
from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.models.loading import load_policy
from vlrft.vision import mm_token_type_ids


def forward_last_logits(model, batch, encoder):
    ids, mask = batch.left_pad(encoder.pad_token_id)
    types = mm_token_type_ids(ids, encoder.image_token_id, encoder.video_token_id)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, **batch.visual.model_inputs())
    return out.logits[:, -1]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_batched_forward_matches_each_prompt_alone(arch, tiny_vlm_dir, tiny_processor):
    model = load_policy(tiny_vlm_dir(arch), dtype="float32").eval()
    encoder = PromptEncoder(tiny_processor(arch), DataConfig(video_fps=2.0))
    frames = [noise_image(56, 56, seed=20 + i) for i in range(4)]
    samples = [
        Sample("text", "Describe a red circle in a few words."),
        Sample("one", "<image>What color is the shape?", images=[noise_image(56, 84, seed=1)]),
        Sample("two", "Compare <image> and <image>.", images=[noise_image(56, 56, seed=2), noise_image(84, 56, seed=3)]),
        Sample("video", "<video>What happens?", videos=[frames]),
    ]
    batch = encoder.encode(samples).batch
    together = forward_last_logits(model, batch, encoder)
    for i in range(len(samples)):
        alone = forward_last_logits(model, batch.select([i]), encoder)
        torch.testing.assert_close(together[i], alone[0], rtol=1e-4, atol=1e-4)
    # a group of completions shares its prompt by index: repeated rows give repeated logits
    group = forward_last_logits(model, batch.select([2, 2, 1]), encoder)
    torch.testing.assert_close(group[0], together[2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(group[1], together[2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(group[2], together[1], rtol=1e-4, atol=1e-4)

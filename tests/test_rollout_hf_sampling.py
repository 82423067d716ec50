"""The embedded HF engine samples from the distribution the config names, not the checkpoint's defaults."""

from __future__ import annotations

import torch
from PIL import Image


def test_top_k_off_is_not_overridden_by_the_checkpoint_generation_config(tiny_vlm_dir):
    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder
    from vlrft.data.sample import Sample
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.rollout.base import SamplingParams
    from vlrft.rollout.hf import HFEngine, TokenSpec

    folder = tiny_vlm_dir()
    processor, model = load_processor(folder), load_policy(folder)
    model.generation_config.top_k = 1  # what a checkpoint's generation_config.json may carry
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    sample = Sample(id="red", prompt="<image>What color is the shape?", images=[Image.new("RGB", (56, 56), (200, 30, 30))])
    batch = PromptEncoder(processor, DataConfig()).encode([sample]).batch
    engine = HFEngine(lambda: model, processor, tokens)

    torch.manual_seed(0)
    rollouts = engine.generate(batch, SamplingParams(n=6, max_new_tokens=6, temperature=1.0, top_k=0))

    # With the checkpoint's top_k=1 leaking in, all six completions would be the same greedy one.
    assert len({tuple(ids) for ids in rollouts.completion_ids}) > 1

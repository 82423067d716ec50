"""A random tiny model in training mode and its ActorVL, for the tests that measure a training forward's memory; rows
over three prompts for the tests of the shared-prompt forward."""

from __future__ import annotations

from pathlib import Path

from vlrft.batch import build_sequences
from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.models.actor import ActorVL
from vlrft.models.loading import load_processor
from vlrft.models.tiny import TinySpec, build_tiny_model, build_tokenizer
from vlrft.tokens import TokenSpec


def training_actor(spec: TinySpec, checkpointing: bool = True):
    """(a random model of `spec` in training mode, no KV cache, with gradient checkpointing if asked; its ActorVL;
    its tokenizer)."""
    tokenizer = build_tokenizer(spec.vocab_size)
    model = build_tiny_model(spec, tokenizer)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model, ActorVL(model, model.config.image_token_id, model.config.video_token_id), tokenizer


def three_prompt_rows(folder, image_dir: Path, completions: list[list[int]], config):
    """(TokenSpec, rows) of the tiny model in `folder` (its `config`) over 3 prompts of different lengths (an image,
    text, two images), two rows each, with `completions` (6 lists of token ids)."""
    from PIL import Image

    processor = load_processor(folder)
    Image.new("RGB", (64, 96), (200, 40, 40)).save(image_dir / "red.png")
    samples = [Sample(id="img", prompt="<image>Color?", images=[str(image_dir / "red.png")]),
               Sample(id="text", prompt="A longer text-only prompt here"),
               Sample(id="two", prompt="<image><image>Same?", images=[str(image_dir / "red.png")] * 2)]
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=8192)).encode(samples).batch
    tokens = TokenSpec.from_model(processor, config)
    return tokens, build_sequences(batch.prompt_ids, batch.visual, completions, [0, 0, 1, 1, 2, 2], tokens.pad_id)

"""What the rollout-engine tests start from: a tiny model loaded for generation and a batch of encoded prompts."""

from __future__ import annotations

from pathlib import Path

from vlrft.config import DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.models.loading import load_policy, load_processor
from vlrft.tokens import TokenSpec


def solid_png(folder: Path, name: str, color: tuple[int, int, int], size: int = 56) -> str:
    """A one-colour square PNG in `folder`; its path."""
    from PIL import Image

    path = folder / f"{name}.png"
    Image.new("RGB", (size, size), color).save(path)
    return str(path)


def engine_setup(model_folder, samples: list[Sample], max_pixels: int = 3136):
    """(processor, model in eval mode, TokenSpec, PromptBatch of `samples`) for a tiny model folder."""
    processor = load_processor(model_folder)
    model = load_policy(model_folder).eval()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=max_pixels)).encode(samples).batch
    return processor, model, tokens, batch

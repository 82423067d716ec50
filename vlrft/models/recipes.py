"""Model recipes: build a starting policy that does not exist yet (`model.build_recipe` in the config).

The CPU demo needs a policy that already answers in the task's format but does not yet know the
answer: `shapes-demo` builds a tiny Qwen2-VL (random weights, local tokenizer) and gives it a short
supervised *format* warm start on a warm-up split disjoint from train/test made of blank images
with balanced answers, so it learns to reply with one colour word and stop, while the
image-to-answer link is left for RL to find (it starts at chance, 1/number of colours).
Everything is seeded: the same recipe gives the same weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vlrft.errors import UserError


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm start settings."""

    steps: int = 60
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0


def supervised_warm_start(model_dir: Path, samples: list, settings: WarmStart, data_cfg=None) -> dict[str, float]:
    """Train `model_dir` in place with cross-entropy on each sample's answer + end-of-turn token."""
    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder
    from vlrft.models.actor import ActorVL
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.tokens import TokenSpec
    from vlrft.batch import build_sequences

    processor = load_processor(model_dir)
    model = load_policy(model_dir).train()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    encoder = PromptEncoder(processor, data_cfg or DataConfig())
    end_of_turn = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    rng = np.random.default_rng(settings.seed)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        for _ in range(settings.steps):
            picked = [samples[i] for i in rng.choice(len(samples), size=settings.batch_size, replace=False)]
            batch = encoder.encode(picked).batch
            targets = [processor.tokenizer(s.answer, add_special_tokens=False).input_ids + [end_of_turn] for s in picked]
            seqs = build_sequences(batch.prompt_ids, batch.visual, targets, list(range(len(picked))), tokens.pad_id)
            losses.append(supervised_step(actor, optimizer, seqs))
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"warm_start/first_loss": losses[0], "warm_start/last_loss": losses[-1]}


def supervised_step(actor, optimizer: torch.optim.Optimizer, seqs) -> float:
    """One warm-start step: mean negative log-likelihood of the completion tokens; returns the loss."""
    out = actor.logprobs(seqs)
    loss = -(out.logprobs * seqs.completion_mask).sum() / seqs.completion_mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def build_shapes_demo(out_dir: Path) -> Path:
    """Tiny Qwen2-VL + format warm start on shuffled-answer shapes (see the module docstring)."""
    from vlrft.config import DataConfig
    from vlrft.data import read_samples
    from vlrft.data.synthetic import ShapesSpec, make_split
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    spec = TinySpec(arch="qwen2_vl", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    vision_depth=2, vision_hidden_size=32, vision_heads=2, min_pixels=56 * 56, max_pixels=56 * 56, vocab_size=1024,
                    seed=0)
    build_tiny_vlm(out_dir, spec)
    warmup_dir = out_dir / "warmup_data"
    # Blank images with balanced answers: the model learns to answer with one colour word and stop,
    # and cannot learn which colour (every image is the same), so it starts at chance.
    path = make_split(warmup_dir, ShapesSpec(seed=1, blank_images=True), "warmup", 128)
    samples = read_samples(path)
    metrics = supervised_warm_start(out_dir, samples, WarmStart(), DataConfig(min_pixels=56 * 56, max_pixels=56 * 56))
    shutil.rmtree(warmup_dir)
    (out_dir / "vlrft_recipe.json").write_text(json.dumps({"recipe": "shapes-demo", **metrics}, indent=1))
    return out_dir


RECIPES: dict[str, Callable[[Path], Path]] = {"shapes-demo": build_shapes_demo}
# Recipes built with layers above the models (the multi-turn zoom demo needs the rollout layer), named by
# 'module:function' and imported only when used, so this layer never imports upward.
RECIPE_REFERENCES: dict[str, str] = {"zoom-demo": "vlrft.rollout.zoom_demo:build_zoom_demo"}


def ensure_model(path: str, recipe: str | None) -> None:
    """Build `path` with `recipe` when the folder does not exist yet (no-op otherwise)."""
    target = Path(path)
    if recipe is None or (target / "config.json").is_file():
        return
    if recipe not in RECIPES and recipe not in RECIPE_REFERENCES:
        raise UserError(f"config: model.build_recipe={recipe!r} is not a known recipe; expected one of "
                        f"{', '.join(sorted([*RECIPES, *RECIPE_REFERENCES]))} or null")
    if recipe in RECIPE_REFERENCES:
        from vlrft.registry import load_reference

        builder = load_reference(RECIPE_REFERENCES[recipe], f"model.build_recipe={recipe!r}")
    else:
        builder = RECIPES[recipe]
    tmp = target.with_name(target.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    builder(tmp)
    tmp.rename(target)  # whole or not at all: a crash mid-build leaves no half-built model behind

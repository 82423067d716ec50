"""Model recipes: build a starting policy that does not exist yet (`model.build_recipe` in the config).

`model.build_recipe` names a function ('module:function' or 'path/to/file.py:function') that fills a
model folder; `ensure_model` calls it once, when `model.path` does not exist yet. The pieces a recipe
uses to give a fresh model a short supervised warm start (`supervised_warm_start`, `supervised_step`)
live here; the CPU demos' recipes are in examples/demo_models.py.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

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


def ensure_model(path: str, recipe: str | None) -> None:
    """Build `path` with `recipe` ('module:function' or 'path/to/file.py:function', called with the folder to
    fill) when the folder does not exist yet (no-op otherwise). The folder appears whole or not at all."""
    target = Path(path)
    if recipe is None or (target / "config.json").is_file():
        return
    if ":" not in recipe:
        raise UserError(f"config: model.build_recipe={recipe!r} is not a reference; give 'module:function' or "
                        "'path/to/file.py:function' (a function that writes a model folder, e.g. "
                        "examples/demo_models.py:build_shapes_demo), or null")
    from vlrft.registry import load_reference

    builder = load_reference(recipe, f"model.build_recipe={recipe!r}")
    tmp = target.with_name(target.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    builder(tmp)
    tmp.rename(target)  # whole or not at all: a crash mid-build leaves no half-built model behind

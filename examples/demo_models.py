"""The CPU demos' starting models, named by `model.build_recipe` in configs/demo.yaml and configs/zoom_demo.yaml.

Each demo needs a policy that already answers in the task's format but does not yet know the answer:
- `build_shapes_demo`: a tiny Qwen2-VL (random weights, local tokenizer) with a short supervised *format*
  warm start on a warm-up split (disjoint from train/test) of blank images with balanced answers, so it
  learns to reply with one colour word and stop, while the image-to-answer link is left for RL to find
  (it starts at chance, 1/number of colours);
- `build_zoom_demo`: the same tiny model with a warm start on both answer formats (at once, or "zoom"
  then answer) on images without a mark, and colour naming on close-ups shown as the prompt's image.
  The two-turn sequences are built with the multi-turn rollout's own observation template and layout.
Everything is seeded: the same recipe gives the same weights. Demo code, not library code: vlrft itself
only calls the function a config names.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

if __package__ != "examples":  # loaded by path from a config: make `examples` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.shapes import ShapesSpec, make_split  # noqa: E402
from examples.zoom_marks import make_zoom_marks  # noqa: E402
from vlrft.models.recipes import WarmStart, supervised_step, supervised_warm_start  # noqa: E402

WARM_START_STEPS = 600  # alternating format / colour-naming steps of 16 sequences


def zoom_warm_start(model_dir: Path, samples: list, closeups: list, settings: WarmStart, data_cfg,
                    tool_max_pixels: int) -> dict[str, float]:
    """Warm start for the zoom demo, alternating two kinds of supervised steps:

    * format, on images without a mark: half the sequences answer with a colour word at once, half say "zoom",
      read the zoomed (still empty) centre and then answer. The model learns both formats, not which colour;
    * colour naming, on `closeups` (centre cells with a plain mark, shown as the prompt's image at the tool-image
      resolution): the model learns to name a colour it can see, as a pretrained VLM can.
    It never sees a marked image after zooming: that zooming makes the mark readable is left for RL to find.
    """
    from vlrft.batch import build_sequences
    from vlrft.data import PromptEncoder
    from vlrft.models.actor import ActorVL
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.rollout.multiturn import ObservationTemplate, Trajectories
    from vlrft.tokens import TokenSpec
    from vlrft.tools import ToolCall, ToolContext, ToolStats
    from vlrft.tools.builtin import zoom
    from vlrft.tools.toolset import as_output

    processor = load_processor(model_dir)
    model = load_policy(model_dir).train()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    encoder = PromptEncoder(processor, data_cfg)
    closeup_encoder = PromptEncoder(processor, dataclasses.replace(data_cfg, max_pixels=tool_max_pixels))
    # No tool schemas in the prompt (configs/zoom_demo.yaml: rollout.describe_tools=false): the tiny model calls the
    # tool with the word "zoom", and the schemas would make every prompt ~700 tokens instead of ~30.
    observations = ObservationTemplate(processor, encoder.image_bounds(tool_max_pixels))
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    words = lambda text: processor.tokenizer(text, add_special_tokens=False).input_ids + [end]  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    rng = np.random.default_rng(settings.seed)
    losses = []

    def format_step() -> float:
        picked = [samples[i] for i in rng.choice(len(samples), size=settings.batch_size, replace=False)]
        batch = encoder.encode(picked).batch
        rows: dict[str, list] = {k: [] for k in ("completion_ids", "sampled_mask", "observation_visual")}
        for i, sample in enumerate(picked):
            answer = words(sample.answer)
            if i % 2:
                ids, mask, visual = answer, [1] * len(answer), None
            else:
                first = words("zoom")
                context = ToolContext(images=list(batch.images[i]), sample=sample, turn=1)
                output = as_output(zoom(ToolCall("zoom", {"region": "center"}), context))
                obs, visual, _ = observations.encode(output, first, encoder.merge_size)
                ids, mask = first + obs + answer, [1] * len(first) + [0] * len(obs) + [1] * len(answer)
            for key, value in zip(rows, (ids, mask, visual)):
                rows[key].append(value)
        n = len(picked)
        trajectories = Trajectories(n=1, finish_reasons=["stop"] * n, turns=[1] * n, tool_rewards=[0.0] * n,
                                    tool_stats=[ToolStats() for _ in range(n)], texts=[""] * n,
                                    observation_images=[[] for _ in range(n)], **rows)
        return supervised_step(actor, optimizer, trajectories.sequences(batch, list(range(n)), tokens.pad_id))

    def naming_step() -> float:
        picked = [closeups[i] for i in rng.choice(len(closeups), size=settings.batch_size, replace=False)]
        batch = closeup_encoder.encode(picked).batch
        answers = [words(s.answer) for s in picked]
        return supervised_step(actor, optimizer, build_sequences(batch.prompt_ids, batch.visual, answers,
                                                                 list(range(len(picked))), tokens.pad_id))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        for step in range(settings.steps):
            losses.append(naming_step() if step % 2 else format_step())
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"warm_start/first_loss": losses[0], "warm_start/last_format_loss": losses[-2],
            "warm_start/last_naming_loss": losses[-1]}


def build_zoom_demo(out_dir: Path) -> Path:
    """Tiny Qwen2-VL (as build_shapes_demo) + the format and colour-naming warm start of `zoom_warm_start`."""
    from vlrft.config import DataConfig
    from vlrft.data import read_samples
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    # Heads of 32 dimensions (2 x 32, one KV head: the parameter count of 4 x 16 with two KV heads), the narrowest
    # vLLM's CPU attention kernels take, so the demo also runs on rollout.engine=vllm / vllm_server on a CPU.
    spec = TinySpec(arch="qwen2_vl", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                    vision_depth=2, vision_hidden_size=32, vision_heads=2, min_pixels=56 * 56, max_pixels=112 * 112,
                    vocab_size=1024, seed=0)
    build_tiny_vlm(out_dir, spec)
    warmup_dir = out_dir / "warmup_data"
    samples = read_samples(make_zoom_marks(warmup_dir, "warmup", 128, seed=1, blank=True))
    closeups = read_samples(make_zoom_marks(warmup_dir, "closeup", 512, seed=2, closeup=True))
    metrics = zoom_warm_start(out_dir, samples, closeups, WarmStart(steps=WARM_START_STEPS, lr=1e-3),
                              DataConfig(min_pixels=56 * 56, max_pixels=56 * 56), tool_max_pixels=112 * 112)
    shutil.rmtree(warmup_dir)
    (out_dir / "vlrft_recipe.json").write_text(json.dumps({"recipe": "zoom-demo", **metrics}, indent=1))
    return out_dir


def build_shapes_demo(out_dir: Path) -> Path:
    """Tiny Qwen2-VL + format warm start on shuffled-answer shapes (see the module docstring)."""
    from vlrft.config import DataConfig
    from vlrft.data import read_samples
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    # Heads of 32 dimensions (2 x 32, one KV head: the parameter count of 4 x 16 with two KV heads), the narrowest
    # vLLM's CPU attention kernels take, so the demo also runs on rollout.engine=vllm / vllm_server on a CPU.
    spec = TinySpec(arch="qwen2_vl", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
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

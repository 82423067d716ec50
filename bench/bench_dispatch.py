#!/usr/bin/env python
"""Torch ops dispatched by one training phase (`update`), with the vision tower's attention per segment length
(vlrft's default) and per segment (transformers' SDPA path).

    python bench/bench_dispatch.py                       # one 448 px image per micro-batch
    python bench/bench_dispatch.py --micro-batch 16      # four per micro-batch

On a GPU a small model's training phase is bound by launching kernels, not by arithmetic
(docs/gpu_results.md), so the number of ops a step dispatches is what it costs there. The model has the
layer counts of `tools/gpu_bench.py --size 0.5b` (24 text layers, a 32-block Qwen2.5-VL vision tower,
the 151,936-token vocabulary) with narrow widths, so it runs on CPU in seconds; the op count does not
depend on the widths. Each step: 4 prompts of one 448 px image, groups of 4, 64 tokens per completion,
gradient checkpointing on. Counted with a `TorchDispatchMode` over the second step's `update` (every op
that reaches the dispatcher: forward, backward, recomputation, optimizer).

    python bench/bench_dispatch.py --decode              # one decode step: the lean step vs transformers' layers

counts the ops of one decode step of the hf engine under bf16 autocast, as GPUs run it (there each op is one
or more kernels replayed in a CUDA graph). On CPU an RMSNorm dispatches its parts (pow, mean, rsqrt, ...),
which a GPU runs as one kernel.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_model(out: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlrft.models.tiny import TinySpec, build_config, build_processor

    spec = TinySpec(arch="qwen2_5_vl", hidden_size=64, intermediate_size=128, num_layers=24, num_heads=4,
                    num_kv_heads=2, vision_depth=32, vision_hidden_size=32, vision_heads=2, min_pixels=28 * 28 * 4,
                    max_pixels=28 * 28 * 1280, tie_word_embeddings=True)
    processor = build_processor(spec)
    config = build_config(spec, processor.tokenizer)
    config.text_config.vocab_size = 151936
    config.vision_config.fullatt_block_indexes = [7, 15, 23, 31]
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    processor.save_pretrained(out)


def _counting(ops: collections.Counter):
    """A dispatch mode that counts into `ops` each torch op reaching the dispatcher, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    return Count


def count(model: Path, folder: Path, micro_batch: int, per_segment: bool) -> tuple[int, int]:
    """(dispatched ops, SDPA forward calls) of one training phase."""
    import vlrft.models.actor as actor_module

    if per_segment:
        actor_module.use_segment_attention = lambda vision: False
    import vlrft.trainer.trainer as trainer_module
    from vlrft.config import load_config
    from vlrft.trainer.trainer import Trainer

    side = 448 * 448
    cfg = load_config(None, [f"model.path={model}", "model.dtype=bfloat16", "model.gradient_checkpointing=true",
                             f"data.train_files=[{REPO / 'datasets/shapes_demo/train.parquet'}]",
                             "data.format=native", f"data.min_pixels={side}", f"data.max_pixels={side}",
                             "rollout.n=4", "rollout.global_batch_completions=16", "rollout.max_new_tokens=64",
                             "rollout.min_new_tokens=64", "reward.functions=[{name: exact_match}]",
                             f"train.output_dir={folder / ('per_segment' if per_segment else 'per_length')}",
                             f"train.micro_batch_completions_per_rank={micro_batch}", "train.total_steps=2",
                             "train.skip_zero_advantage_rows=false", "train.eval_before_training=false",
                             "logging.tensorboard=false", "logging.progress=false", "logging.completions_every=0"])
    trainer = Trainer(cfg)
    trainer.train_step()
    ops = collections.Counter()
    Count = _counting(ops)

    update = trainer_module.update

    def counted(*args, **kwargs):
        with Count():
            return update(*args, **kwargs)

    trainer_module.update = counted
    trainer.train_step()
    sdpa = sum(n for name, n in ops.items() if "attention" in name and "backward" not in name)
    return sum(ops.values()), sdpa


def count_decode(model_dir: Path, lean: bool, long_prompt: bool) -> int:
    """Dispatched ops of one decode step of the hf engine under bf16 autocast (the trainer's mixed precision on a
    GPU: float32 weights, bf16 matmuls): 4 prompts x group 4; a text prompt (its cache copied per row) or a 448 px
    image prompt (256 image tokens: held once per group, `LeanDecoder(share_prompt=True)`). `lean`: the lean step,
    else transformers' layers over a dynamic cache."""
    import torch
    from PIL import Image

    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder, Sample
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.decoding.lean import LeanDecoder
    from vlrft.decoding.transformers_layers import TransformersDecoder
    from vlrft.rollout.base import SamplingParams
    from vlrft.rollout.hf import HFEngine
    from vlrft.tokens import TokenSpec

    processor = load_processor(model_dir)
    model = load_policy(model_dir).float().eval()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    image = model_dir / "image.png"
    Image.new("RGB", (448, 448), (200, 40, 40)).save(image)
    samples = [Sample(id=str(i), prompt=("<image>" if long_prompt else "") + f"Which shape is it? ({i})",
                      images=[str(image)] if long_prompt else []) for i in range(4)]
    side = 448 * 448
    batch = PromptEncoder(processor, DataConfig(min_pixels=side, max_pixels=side)).encode(samples).batch
    ops = collections.Counter()
    Count = _counting(ops)

    counted_step = 3  # a step well inside the call (not the first, which may set things up)
    if lean:
        step = LeanDecoder.step

        def lean_step(self, new, index):
            with Count() if index == counted_step else contextlib.nullcontext():
                return step(self, new, index)

        LeanDecoder.step = lean_step
    else:
        forward = TransformersDecoder._forward
        calls = []

        def transformers_step(self, *args):
            calls.append(None)
            with Count() if len(calls) == counted_step + 1 else contextlib.nullcontext():
                return forward(self, *args)

        TransformersDecoder._forward = transformers_step
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=True, static_cache=False, lean_decode=lean,
                      cuda_graph_decode=False, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    try:
        engine.generate(batch, SamplingParams(n=4, max_new_tokens=8, min_new_tokens=8))
    finally:  # the next count wraps the step afresh
        if lean:
            LeanDecoder.step = step
        else:
            TransformersDecoder._forward = forward
    return sum(ops.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch", type=int, default=4, help="completions per micro-batch (4 = one prompt)")
    p.add_argument("--decode", action="store_true", help="count the ops of one decode step instead")
    p.add_argument("--worker", choices=["per_length", "per_segment"], help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.decode:
        with tempfile.TemporaryDirectory() as tmp:
            build_model(Path(tmp) / "model")
            print("one decode step of 16 rows under bf16 autocast, 24 text layers: dispatched torch ops (per layer)")
            for long_prompt, layout in ((False, "text prompt, cache per row"), (True, "448 px prompt, shared")):
                for lean, name in ((False, "transformers' layers"), (True, "lean step (vlrft)")):
                    n = count_decode(Path(tmp) / "model", lean, long_prompt)
                    print(f"  {layout:<28} {name:<22} {n:>6} ({n / 24:.1f})")
        return
    if args.worker:  # one variant per process: the switch is made when the model is wrapped
        folder = Path(args.folder)
        ops, sdpa = count(folder / "model", folder, args.micro_batch, args.worker == "per_segment")
        print(f"{ops} {sdpa}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder / "model")
        results = {}
        for variant in ("per_segment", "per_length"):
            done = subprocess.run([sys.executable, __file__, "--worker", variant, "--folder", tmp,
                                   "--micro-batch", str(args.micro_batch)], capture_output=True, text=True,
                                  check=True)
            results[variant] = [int(x) for x in done.stdout.split()[-2:]]
    print(f"one training phase, 16 completions in micro-batches of {args.micro_batch} "
          f"({args.micro_batch // 4} image(s) each): dispatched torch ops (SDPA forward calls)")
    print(f"  vision attention per segment (transformers): {results['per_segment'][0]:>8} "
          f"({results['per_segment'][1]})")
    print(f"  per segment length (vlrft):                  {results['per_length'][0]:>8} "
          f"({results['per_length'][1]})")


if __name__ == "__main__":
    main()

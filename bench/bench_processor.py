#!/usr/bin/env python
"""Processor time per training step: vlrft encodes each prompt once, a naive peer (as TRL's GRPO trainer
does) runs the processor on every prompt repeated n times (once per completion).

    PYTHONPATH=. python bench/bench_processor.py [--prompts 8] [--image-size 336] [--repeats 5]

(On a busy shared machine, OMP_NUM_THREADS=1 keeps torch's thread pool from adding noise.)

For n = 1, 4, 16 completions per prompt it prints both times and their ratio. vlrft's time includes
the completion -> prompt index the trainer uses; pixels are not copied per completion (a micro-batch
slices its own rows with `VisualBatch.select` at forward time, which both approaches pay alike). Runs on CPU with a tiny Qwen2.5-VL processor built locally (the image processor and
tokenizer code paths are the real ones; only the vocabulary is small).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from PIL import Image


def build_inputs(num_prompts: int, image_size: int):
    from vlrft.data import Sample

    rng = np.random.default_rng(0)
    samples = []
    for i in range(num_prompts):
        pixels = rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
        samples.append(Sample(f"p{i}", f"<image>Question {i}: what color is the shape?",
                              images=[Image.fromarray(pixels)]))
    return samples


def time_pair(first, second, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds of two functions, timed alternately so load drift hits both alike."""
    first(), second()  # warm-up
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for k, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - start)
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=336)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder
    from vlrft.data.sample import build_messages
    from vlrft.models.tiny import TinySpec, build_processor

    pixels = args.image_size * args.image_size
    processor = build_processor(TinySpec(arch="qwen2_5_vl", max_pixels=max(pixels, 28 * 28 * 4)))
    cfg = DataConfig(max_pixels=max(pixels, 28 * 28 * 4), max_prompt_length=100_000)
    encoder = PromptEncoder(processor, cfg)
    samples = build_inputs(args.prompts, args.image_size)
    messages = [build_messages(s) for s in samples]
    prepared_images = encoder.encode(samples).batch.images  # the same (fitted) pixels for both sides

    print(f"{args.prompts} prompts, one {args.image_size}x{args.image_size} image each, tiny Qwen2.5-VL processor, "
          f"best of {args.repeats} runs")
    print(f"{'n':>4} {'vlrft (s)':>10} {'naive (s)':>10} {'naive / vlrft':>14}")
    for n in (1, 4, 16):
        def ours():
            batch = encoder.encode(samples).batch
            group = [i for i in range(len(batch)) for _ in range(n)]  # completion -> its prompt's index
            return batch, group, [batch.prompt_ids[i] for i in group]  # ids shared by reference, no pixel copies

        def naive():
            repeated = [m for m in messages for _ in range(n)]
            texts = processor.apply_chat_template(repeated, tokenize=False, add_generation_prompt=True)
            images = [im for ims in prepared_images for im in ims for _ in range(n)]
            return processor(text=texts, images=images, return_tensors="pt", padding=True)

        t_ours, t_naive = time_pair(ours, naive, args.repeats)
        print(f"{n:>4} {t_ours:>10.4f} {t_naive:>10.4f} {t_naive / t_ours:>13.1f}x")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Tokens/s of the hf engine's group decoder (static or dynamic KV cache, optionally compiled) vs `model.generate`.

    python bench/bench_decode.py [--repeats 3] [--tokens 64] [--compile]

A random Qwen2-VL (hidden 256, 4 layers, vocabulary 512; `--hidden`, `--layers`) samples completions
forced to `--tokens` tokens (min_new_tokens = max_new_tokens, so every variant generates the same
number) for each regime: text-only prompts and 112 px image prompts, groups of 4 and 8, 4 prompts
per call. Variants run interleaved, `--repeats` times each; min / median / max tokens/s are printed,
and each variant's median relative to `model.generate`. One thread (`--threads`).
Timings on a loaded machine are indicative only: compare ratios from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REGIMES = [("text, group 4", False, 4), ("text, group 8", False, 8), ("112 px image, group 4", True, 4),
           ("112 px image, group 8", True, 8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="also time rollout.compile_decode=true")
    p.add_argument("--regimes", default="all", help="comma-separated indices into the regime list, or 'all'")
    args = p.parse_args()

    import torch
    from PIL import Image

    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder, Sample
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.models.tiny import TinySpec, build_tiny_vlm
    from vlrft.rollout.base import SamplingParams
    from vlrft.rollout.hf import HFEngine
    from vlrft.tokens import TokenSpec

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_decode_"))
    folder = build_tiny_vlm(work / "model", TinySpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                                                      num_kv_heads=2, intermediate_size=args.hidden * 2,
                                                      min_pixels=112 * 112, max_pixels=112 * 112))
    processor, model = load_processor(folder), load_policy(folder).eval()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    variants = {"generate": dict(share_prompts=False), "group, dynamic cache": dict(static_cache=False),
                "group, static cache": dict(static_cache=True)}
    if args.compile:
        variants["group, static, compiled"] = dict(static_cache=True, compile_decode=True)
    chosen = REGIMES if args.regimes == "all" else [REGIMES[int(i)] for i in args.regimes.split(",")]
    print(f"{args.tokens} tokens per completion, {args.prompts} prompts per call, {args.threads} thread(s); "
          f"tokens/s min / median / max over {args.repeats} interleaved repeats")
    for name, with_image, group in chosen:
        samples = [Sample(id=str(i), prompt=("<image>" if with_image else "") + f"Question {i}: describe the shape.",
                          images=[image] if with_image else []) for i in range(args.prompts)]
        batch = PromptEncoder(processor, DataConfig(min_pixels=112 * 112, max_pixels=112 * 112)).encode(samples).batch
        sampling = SamplingParams(n=group, max_new_tokens=args.tokens, min_new_tokens=args.tokens, temperature=1.0)
        engines = {v: HFEngine(lambda: model, processor, tokens, **opts) for v, opts in variants.items()}
        for engine in engines.values():  # warm-up (and compile) outside the timing
            engine.generate(batch, sampling)
        rates: dict[str, list[float]] = {v: [] for v in engines}
        for _ in range(args.repeats):
            for variant, engine in engines.items():
                start = time.perf_counter()
                out = engine.generate(batch, sampling)
                elapsed = time.perf_counter() - start
                rates[variant].append(sum(len(ids) for ids in out.completion_ids) / elapsed)
        base = statistics.median(rates["generate"])
        print(f"\n{name}:")
        for variant, values in rates.items():
            med = statistics.median(values)
            print(f"  {variant:<24} {min(values):7.0f} / {med:7.0f} / {max(values):7.0f} tok/s   "
                  f"{med / base:5.2f}x generate")


if __name__ == "__main__":
    main()

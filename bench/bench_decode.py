#!/usr/bin/env python
"""Tokens/s of the hf engine's group decoder variants (vlrft.decoding.table) vs `model.generate`.

    python bench/bench_decode.py [--repeats 3] [--tokens 64]
    python bench/bench_decode.py --device cuda --dtype bfloat16 --hidden 896 --layers 24 --tokens 256
    python bench/bench_decode.py --device cuda --autocast bfloat16 --hidden 896 --layers 24 --tokens 256
    python bench/bench_decode.py --family smolvlm --regimes 0,3

`--family` (qwen2_vl by default; any of vlrft.models.tiny's architectures, e.g. gemma3, internvl,
llava_onevision, smolvlm: the 1-D-position families) picks the tiny model's architecture; a family whose text
decoder the lean step does not take (Gemma 3: sliding-window layers) times `generate` against transformers' layers
only (the variants it would decode with), and one with sliding-window layers never with the static cache.

A random Qwen2-VL (or `--family`; hidden 256, 4 layers, vocabulary 512; `--hidden`, `--layers`) samples completions
forced to `--tokens` tokens (min_new_tokens = max_new_tokens, so every variant generates the same
number) for each regime: text-only prompts and 112 px image prompts, groups of 4 and 8, 4 prompts
per call. Variants run interleaved, `--repeats` times each; min / median / max tokens/s are printed,
and each variant's median relative to `model.generate`, per wall-clock second and per second of
this process's CPU time (on a shared machine the steadier of the two: it leaves out the time other
jobs held the core). One thread (`--threads`). `--autocast bfloat16` samples from float32 weights under bf16
autocast, as the trainer's hf engine does on GPUs (its mixed precision). Compare ratios from the same run only. "fixed shapes" is
`rollout.cuda_graph_decode`: on CUDA its steps are replayed as a CUDA graph, on CPU they run eagerly.

The variants of `vlrft.decoding.table.VARIANTS` each one times: "group, dynamic cache" transformers_dynamic,
"group, static cache" transformers_static, "group, lean step" lean, "group, lean, fixed shapes" cuda_graph on CUDA
(fixed_rows elsewhere); "group, lean, unpacked" the lean step's weights read in place instead of packed (CPU).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import shutil
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
    p.add_argument("--family", default="qwen2_vl", help="the tiny model's architecture (vlrft.models.tiny)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--regimes", default="all", help="comma-separated indices into the regime list, or 'all'")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="the model's dtype (e.g. bfloat16 on a GPU)")
    p.add_argument("--prompt-repeat", type=int, default=1, help="repeat each prompt's question this many times (long "
                   "prompts; adds the variants 'prompt per row' and 'shared prompt', the lean step's prompt KV cache "
                   "forced either way, eagerly and in fixed shapes: by default it is shared from "
                   "vlrft.sampling.SHARED_PROMPT_TOKENS tokens)")
    p.add_argument("--skip", default="", help="variants to leave out, separated by ';' (e.g. 'group, static cache'); "
                   "'generate' is the baseline and stays")
    p.add_argument("--autocast", default=None, help="sample under autocast in this dtype (e.g. bfloat16): the "
                   "trainer's mixed precision on GPUs, float32 weights")
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
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    spec = TinySpec(arch=args.family, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                    intermediate_size=args.hidden * 2, min_pixels=112 * 112, max_pixels=112 * 112)
    folder = build_tiny_vlm(work / "model", spec)
    processor = load_processor(folder)
    model = load_policy(folder).to(args.device, getattr(torch, args.dtype)).eval()
    cuda = args.device.startswith("cuda")
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    image = Image.new("RGB", (112, 112), (200, 40, 40))
    variants = {"generate": dict(share_prompts=False),
                "group, dynamic cache": dict(static_cache=False, lean_decode=False, cuda_graph_decode=False),
                "group, static cache": dict(static_cache=True, lean_decode=False, cuda_graph_decode=False),
                "group, lean step": dict(lean_decode=True, cuda_graph_decode=False),
                "group, lean, unpacked": dict(lean_decode=True, cuda_graph_decode=False),  # weights as views: see `unpacked`
                "group, lean, fixed shapes": dict(lean_decode=True, cuda_graph_decode=True)}
    if args.prompt_repeat > 1:  # long prompts: each prompt's KV cache copied per row / held once, whatever its length
        variants["group, lean, prompt per row"] = dict(lean_decode=True, cuda_graph_decode=False)
        variants["group, lean, shared prompt"] = dict(lean_decode=True, cuda_graph_decode=False)
        variants["group, lean, fixed shapes, prompt per row"] = dict(lean_decode=True, cuda_graph_decode=True)
        variants["group, lean, fixed shapes, shared prompt"] = dict(lean_decode=True, cuda_graph_decode=True)
    if cuda or args.autocast:  # nothing is packed on CUDA or under autocast
        del variants["group, lean, unpacked"]
    for name in filter(None, (v.strip() for v in args.skip.split(";"))):
        if name == "generate" or name not in variants:
            raise SystemExit(f"--skip {name!r}: not a variant that can be left out ({'; '.join(list(variants)[1:])})")
        del variants[name]
    for name in family_variants_left_out(model, variants):
        del variants[name]
    chosen = REGIMES if args.regimes == "all" else [REGIMES[int(i)] for i in args.regimes.split(",")]
    print(f"{args.tokens} tokens per completion, {args.prompts} prompts per call, {args.threads} thread(s); "
          f"tokens/s min / median / max over {args.repeats} interleaved repeats")
    for name, with_image, group in chosen:
        samples = [Sample(id=str(i), prompt=("<image>" if with_image else "")
                          + f"Question {i}: describe the shape. " * args.prompt_repeat,
                          images=[image] if with_image else []) for i in range(args.prompts)]
        batch = PromptEncoder(processor, DataConfig(min_pixels=112 * 112, max_pixels=112 * 112,
                                                max_prompt_length=1 << 20)).encode(samples).batch
        sampling = SamplingParams(n=group, max_new_tokens=args.tokens, min_new_tokens=args.tokens, temperature=1.0)
        autocast = None if args.autocast is None else (
            lambda: torch.autocast(torch.device(args.device).type, dtype=getattr(torch, args.autocast)))
        engines = {v: HFEngine(lambda: model, processor, tokens, autocast=autocast, **opts) for v, opts in variants.items()}
        for variant, engine in engines.items():  # warm-up outside the timing
            with unpacked(variant.endswith("unpacked")), prompt_kv(variant):
                engine.generate(batch, sampling)
        rates: dict[str, list[float]] = {v: [] for v in engines}
        cpu_rates: dict[str, list[float]] = {v: [] for v in engines}
        for _ in range(args.repeats):
            for variant, engine in engines.items():
                if cuda:
                    torch.cuda.synchronize()
                start, start_cpu = time.perf_counter(), time.process_time()
                with unpacked(variant.endswith("unpacked")), prompt_kv(variant):
                    out = engine.generate(batch, sampling)
                if cuda:
                    torch.cuda.synchronize()
                elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                generated = sum(len(ids) for ids in out.completion_ids)
                rates[variant].append(generated / elapsed)
                cpu_rates[variant].append(generated / elapsed_cpu)
        base, cpu_base = statistics.median(rates["generate"]), statistics.median(cpu_rates["generate"])
        prompt_len = max(len(ids) for ids in batch.prompt_ids)
        print(f"\n{name}, prompts of up to {prompt_len} tokens:  tokens/s (wall) min/median/max, x generate | "
              "tokens per CPU-second min/median/max, x generate")
        for variant in rates:
            wall, cpu = rates[variant], cpu_rates[variant]
            print(f"  {variant:<42} {min(wall):6.0f}/{statistics.median(wall):6.0f}/{max(wall):6.0f} "
                  f"{statistics.median(wall) / base:5.2f}x | {min(cpu):6.0f}/{statistics.median(cpu):6.0f}/"
                  f"{max(cpu):6.0f} {statistics.median(cpu) / cpu_base:5.2f}x")


def family_variants_left_out(model, variants: dict) -> list[str]:
    """The variants that would not decode as named on this model: the lean ones where the lean step refuses its text
    decoder (they would run transformers' layers), the static cache where it has sliding-window layers."""
    from vlrft.decoding.lean_weights import unsupported_reason
    from vlrft.decoding.transformers_layers import has_sliding_window, text_model_of
    from vlrft.models.actor import split_head

    text_model = text_model_of(split_head(model)[0])
    out = [v for v in variants if "lean" in v and unsupported_reason(text_model) is not None]
    if has_sliding_window(text_model):
        out.append("group, static cache")
    return [v for v in out if v in variants]


@contextlib.contextmanager
def unpacked(active: bool):
    """The lean step with the model's weights read in place (as on CUDA), not packed for oneDNN (CPU float32)."""
    from vlrft.decoding import lean

    packing_applies = lean.packing_applies
    if active:
        lean.packing_applies = lambda weight: False
    try:
        yield
    finally:
        lean.packing_applies = packing_applies


@contextlib.contextmanager
def prompt_kv(variant: str):
    """The "prompt per row" / "shared prompt" variants: the lean decoder's prompt KV layout forced either way."""
    import vlrft.sampling as limits

    threshold = limits.SHARED_PROMPT_TOKENS
    if variant.endswith("prompt per row"):
        limits.SHARED_PROMPT_TOKENS = 1 << 40
    elif variant.endswith("shared prompt"):
        limits.SHARED_PROMPT_TOKENS = 0
    try:
        yield
    finally:
        limits.SHARED_PROMPT_TOKENS = threshold


if __name__ == "__main__":
    main()

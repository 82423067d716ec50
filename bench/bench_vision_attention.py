#!/usr/bin/env python
"""Vision tower forward + backward: transformers' SDPA per segment vs vlrft's SDPA per segment length.

    python bench/bench_vision_attention.py                          # CPU: a narrow Qwen2.5-VL tower, 448 px
    python bench/bench_vision_attention.py --device cuda --dtype bfloat16 --width 1280 --depth 32 --images 8

A random Qwen2.5-VL vision tower (`--depth` blocks of `--width`, windows of 112 px, full attention every 8th
block as released) encodes `--images` images of `--pixels` px (plus one of 7/8 the side: edge windows),
forward and backward, under gradient checkpointing as the trainer trains it. Both variants run interleaved
`--repeats` times; printed: seconds per pass min/median/max (wall and this process's CPU time), the ratio of
medians, dispatched torch ops and SDPA calls per pass, and the largest difference of the features. The
Qwen2.5-VL 3B-72B towers are `--width 1280 --depth 32`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--pixels", type=int, default=448, help="side of each image (px)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch
    from PIL import Image
    from torch.utils._python_dispatch import TorchDispatchMode

    from vlrft.models.actor import vision_module
    from vlrft.models.tiny import TinySpec, build_config, build_processor
    from vlrft.models.vision_attention import switched_copy

    torch.set_num_threads(args.threads)
    spec = TinySpec(arch="qwen2_5_vl", vision_depth=args.depth, vision_hidden_size=args.width,
                    vision_heads=max(1, args.width // 80), max_pixels=args.pixels * args.pixels * 2)
    processor = build_processor(spec)
    config = build_config(spec, processor.tokenizer)
    config.vision_config.fullatt_block_indexes = [i for i in range(args.depth) if i % 8 == 7] or [args.depth - 1]
    config.vision_config.intermediate_size = int(args.width * 2.67)
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    stock = vision_module(model).to(args.device, getattr(torch, args.dtype)).train()
    stock.gradient_checkpointing_enable() if hasattr(stock, "gradient_checkpointing_enable") else None
    grouped = switched_copy(stock)
    side = args.pixels
    images = [Image.new("RGB", (side, side), (200, 40 + i, 40)) for i in range(args.images)]
    small = side * 7 // 8 // 28 * 28  # 392 px for 448: 14 x 14 merged patches, so 4-patch edge windows
    images.append(Image.new("RGB", (small, small), (40, 200, 40)))
    enc = processor.image_processor(images=images, return_tensors="pt")
    pixels = enc["pixel_values"].to(args.device, getattr(torch, args.dtype))
    grid = enc["image_grid_thw"].to(args.device)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.sdpa = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.sdpa += "attention" in func.overloadpacket.__name__ and "backward" not in func.overloadpacket.__name__
            return func(*args, **(kwargs or {}))

    def one_pass(tower):
        x = pixels.clone().requires_grad_(True)
        out = tower(x, grid_thw=grid)
        features = out.pooler_output if hasattr(out, "pooler_output") else out[0]
        features.float().square().mean().backward()
        return features.detach()

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    variants = {"transformers, per segment": stock, "vlrft, per segment length": grouped}
    counts, features = {}, {}
    for name, tower in variants.items():
        features[name] = one_pass(tower)  # warm-up
        with Count() as c:
            one_pass(tower)
        counts[name] = (c.ops, c.sdpa)
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, tower in variants.items():
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            one_pass(tower)
            sync()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    names = list(variants)
    print(f"Qwen2.5-VL vision tower, {args.depth} blocks of {args.width}, {args.images} x {side} px + 1 x {small}"
          f" px ({pixels.shape[0]} patches), {args.device} {args.dtype}, forward + backward with checkpointing; "
          f"{args.repeats} interleaved repeats")
    for name in names:
        w, c = wall[name], cpu[name]
        print(f"  {name:<27} wall s min/median/max {min(w):.4f}/{statistics.median(w):.4f}/{max(w):.4f}  "
              f"CPU s {min(c):.4f}/{statistics.median(c):.4f}/{max(c):.4f}  ops {counts[name][0]}, SDPA calls "
              f"{counts[name][1]}")
    ratio = statistics.median(wall[names[1]]) / statistics.median(wall[names[0]])
    diff = (features[names[1]].float() - features[names[0]].float()).abs().max().item()
    print(f"  vlrft / transformers, median wall: {ratio:.2f}x; features differ by at most {diff:.2e}")


if __name__ == "__main__":
    main()

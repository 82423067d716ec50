#!/usr/bin/env python
"""Peak memory and time of the hf engine's prefill for prompts of different lengths: one padded call vs one per length.

    python bench/bench_prefill.py [--lengths 1024 2048 3072 4096] [--repeats 3]

A random Qwen2-VL (hidden 256, 4 layers; `--hidden`, `--layers`) decodes one token for each of text prompts of
`--lengths` tokens (random ids), once with the padded prefill in one call (its attention mask is [prompts, 1, P, P])
and once prefilled one length at a time, unpadded (`vlrft.sampling.PREFILL_MASK_ELEMENTS`, what the engine does from 2**26
mask elements). Each run is a fresh process (interleaved, `--repeats` each); it prints the process's peak RSS above
its RSS after building the model, and the call's wall time: min / median / max per variant.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VARIANTS = {"one padded call": 1 << 62, "one call per length": 0}


def run_one(folder: str, lengths: list[int], threshold: int) -> dict:
    import torch

    from vlrft.models.loading import load_policy
    from vlrft.decoding import decode_groups, prefill
    from vlrft.rollout.base import SamplingParams
    from vlrft.vision import VisualBatch

    torch.set_num_threads(1)
    model = load_policy(folder).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 400, (n,), generator=generator).tolist() for n in lengths]
    visual = VisualBatch(None, None, None, None, (0,) * len(prompts), (0,) * len(prompts), merge_size=2)
    prefill.PREFILL_MASK_ELEMENTS = threshold
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    decode_groups(model, prompts, visual, SamplingParams(n=1, max_new_tokens=1, temperature=1.0), pad_id=0,
                  stop_ids=set(), image_token_id=-1, video_token_id=-1)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak - before) / 1024, "seconds": elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 3072, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # FOLDER THRESHOLD: one measured run
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child[0], args.lengths, int(args.child[1]))))
        return
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    work = Path(tempfile.mkdtemp(prefix="bench_prefill_"))
    try:
        folder = build_tiny_vlm(work / "model", TinySpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                                                          num_kv_heads=2, intermediate_size=args.hidden * 2))
        runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for _ in range(args.repeats):
            for name, threshold in VARIANTS.items():
                out = subprocess.run([sys.executable, __file__, "--lengths", *map(str, args.lengths), "--child",
                                      str(folder), str(threshold)], capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    padded = len(args.lengths) * max(args.lengths) ** 2
    print(f"prompts of {args.lengths} tokens; the padded call's attention mask: {padded:,} elements; "
          f"min / median / max over {args.repeats} interleaved fresh processes")
    for name, results in runs.items():
        peaks, times = [r["peak_mib"] for r in results], [r["seconds"] for r in results]
        print(f"  {name:<20} peak RSS above the loaded model {min(peaks):7.0f} / {statistics.median(peaks):7.0f} / "
              f"{max(peaks):7.0f} MiB   time {min(times):6.2f} / {statistics.median(times):6.2f} / {max(times):6.2f} s")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Does the CPU demo learn, and does it need the image? Runs the demo, then the blank-image control.

    python bench/demo_learning.py [--output-dir runs/demo_bench] [overrides ...]

1. `vlrft train configs/demo.yaml` from scratch (the starting model is built too), timed end to end;
2. held-out accuracy before training (step 0) and after (last eval), read from metrics.jsonl;
3. the trained model on `datasets/shapes_demo/test_blank.parquet`: the same questions over empty
   images, which must stay near chance (25 %) if the model really reads the picture.
Prints one table; `--json` writes the numbers too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vlrft(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "vlrft", *args], cwd=REPO, env=env, capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/demo_bench")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the demo run")
    args = parser.parse_args()
    out = REPO / args.output_dir
    overrides = [f"train.output_dir={args.output_dir}", f"model.path={args.output_dir}/base_model",
                 "logging.progress=false", "train.overwrite=true", *args.overrides]  # a re-run replaces the last
    start = time.perf_counter()
    run = vlrft("train", "configs/demo.yaml", *overrides)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        return 1
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in line]
    final = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    blank = vlrft("eval", "configs/demo.yaml", *overrides, f"model.path={final / 'model'}", "model.build_recipe=null",
                  "data.eval_files=[datasets/shapes_demo/test_blank.parquet]", "train.output_dir=/tmp/vlrft_blank_eval")
    if blank.returncode != 0:
        print(blank.stderr[-3000:], file=sys.stderr)
        return 1
    blank_accuracy = json.loads(blank.stdout[blank.stdout.index("{"):])["eval/accuracy"]
    results = {"wall_seconds": round(wall, 1), "accuracy_before": evals[0]["eval/accuracy"],
               "accuracy_after": evals[-1]["eval/accuracy"], "steps": evals[-1]["step"],
               "blank_image_accuracy": blank_accuracy,
               "accuracy_by_step": {e["step"]: e["eval/accuracy"] for e in evals}}
    print(f"demo run (build + train + evals): {results['wall_seconds']:.0f} s wall")
    print(f"held-out accuracy: {results['accuracy_before']:.3f} before -> {results['accuracy_after']:.3f} "
          f"after {results['steps']} steps")
    print(f"same model, blank images: {blank_accuracy:.3f} (chance = 0.25)")
    print("by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in results["accuracy_by_step"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

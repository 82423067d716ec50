#!/usr/bin/env python
"""Does multi-turn training with a zoom tool beat the same training without it? The CPU zoom demo, both ways.

    python bench/zoom_demo.py [--output-dir runs/zoom_bench] [overrides ...]

1. the data (`datasets/make_zoom_marks.py`) if it is missing; the starting model is built once
   (examples/demo_models.py:build_zoom_demo, timed on its own);
2. `vlrft train configs/zoom_demo.yaml`: the model may say "zoom" and read the image's centre at a higher resolution;
3. the control: the same config with `rollout.max_turns=1` (same model and prompts, calls never answered);
4. held-out accuracy before and after, tool calls per trajectory and wall time of each, as one table (`--json`).
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


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True)


def train(name: str, out: Path, overrides: list[str]) -> dict:
    start = time.perf_counter()
    done = run("-m", "vlrft", "train", "configs/zoom_demo.yaml", f"train.output_dir={out / name}", *overrides)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{name} run failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "tools/calls" in r]
    return {"wall_seconds": round(wall, 1), "accuracy_before": evals[0]["eval/accuracy"],
            "accuracy_after": evals[-1]["eval/accuracy"], "steps": evals[-1]["step"],
            "tool_calls_last_step": steps[-1]["tools/calls"] if steps else 0.0,
            "accuracy_by_step": {r["step"]: r["eval/accuracy"] for r in evals}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/zoom_bench")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = parser.parse_args()
    out = REPO / args.output_dir
    if not (REPO / "datasets" / "zoom_demo" / "train.jsonl").is_file():
        run("datasets/make_zoom_marks.py")
    overrides = [f"model.path={args.output_dir}/base_model", "logging.progress=false",
                 "train.overwrite=true", *args.overrides]  # a re-run replaces the last one's runs
    start = time.perf_counter()  # the starting model, built once for both runs (build_zoom_demo)
    built = run("-c", f"from vlrft.models.recipes import ensure_model; ensure_model({str(out / 'base_model')!r}, "
                "'examples/demo_models.py:build_zoom_demo')")
    if built.returncode != 0:
        sys.exit(f"building the starting model failed:\n{built.stderr[-3000:]}")
    build_seconds = time.perf_counter() - start
    results = {"with_tool": train("with_tool", out, overrides),
               "without_tool": train("without_tool", out, [*overrides, "rollout.max_turns=1"])}
    print("| run | accuracy before | accuracy after | steps | zoom calls / trajectory (last step) | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        print(f"| {name} | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} | {r['steps']} | "
              f"{r['tool_calls_last_step']:.2f} | {r['wall_seconds']:.0f} |")
    print(f"starting model built in {build_seconds:.0f} s (not in the runs' wall times)")
    gain = results["with_tool"]["accuracy_after"] - results["without_tool"]["accuracy_after"]
    print(f"gain from the tool: {100 * gain:+.1f} points")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

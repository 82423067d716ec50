#!/usr/bin/env python
"""Per-rank memory of DDP vs FSDP2 vs ZeRO-3 on 2 CPU ranks (gloo), measured beside `vlrft plan`'s figures.

    python bench/bench_memory.py [--strategies ddp,fsdp2,deepspeed] [--json results.json]

A random ~125M-parameter Qwen2.5-VL-shaped model (14 decoder layers of 768, a 12-block vision
tower of 512) trains one step with the real trainer under `torchrun --nproc_per_node 2` for each
strategy that `vlrft.parallel.strategy.make_strategy` accepts (others are skipped with a note).
Measured per rank:

- parameters, gradients and optimizer state: the bytes of the distinct tensor storages this rank
  holds for them (local shards of FSDP2 DTensors, ZeRO partitions), taken at the optimizer step
  (a post-step hook, before gradients are freed);
- the peak host RSS while the trainer loads (up to the end of `Trainer.__init__`) and at the end.

Beside them: the plan's parameters + gradients + optimizer for the same config and strategy in
float32 (no mixed precision on CPU); the issue asks for the plan within 15 % of the measurement.
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
sys.path.insert(0, str(REPO))
MIB = 1 << 20


def build_model(out: Path) -> Path:
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    if not (out / "config.json").is_file():
        build_tiny_vlm(out, TinySpec(arch="qwen2_5_vl", hidden_size=768, intermediate_size=2048, num_layers=14,
                                     num_heads=12, num_kv_heads=4, vision_depth=12, vision_hidden_size=512,
                                     vision_heads=8, vocab_size=512))
    return out


def write_config(folder: Path, model: Path, strategy: str, micro_batch: int = 4) -> Path:
    import yaml

    cfg = {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train_files": [str(REPO / "datasets/shapes_demo/train.parquet")], "format": "native",
                 "min_pixels": 3136, "max_pixels": 3136, "max_prompt_length": 256},
        "rollout": {"engine": "hf", "n": 2, "global_batch_completions": 8, "max_new_tokens": 4, "min_new_tokens": 4},
        "reward": {"functions": [{"name": "exact_match"}]},
        "train": {"output_dir": str(folder / f"run_{strategy}"), "skip_zero_advantage_rows": False, "total_steps": 1,
                  "micro_batch_completions_per_rank": micro_batch,
                  "strategy": strategy, "eval_before_training": False},
        "logging": {"tensorboard": False, "progress": False, "completions_every": 0},
    }
    path = folder / f"memory_{strategy}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# ------------------------------------------------------------------ measuring one rank


def _local(tensor):
    """The tensor this rank stores: a DTensor's local shard, a ZeRO-3 parameter's partition, else itself."""
    if hasattr(tensor, "to_local"):
        return tensor.to_local()
    partition = getattr(tensor, "ds_tensor", None)
    return partition if partition is not None else tensor


def _bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.device.type == "meta" or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _torch_optimizers(optimizer):
    """The torch optimizers holding the state (DeepSpeed wraps one as `.optimizer`)."""
    out = [optimizer]
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        out.append(inner)
    return out


def measure_state(model, optimizer) -> dict:
    import torch

    seen: set = set()
    params = list(model.parameters())
    found = {"parameters": _bytes(params, seen)}
    grads = [p.grad for p in params]
    opt_tensors, master = [], []
    for opt in _torch_optimizers(optimizer):
        for group in getattr(opt, "param_groups", []):
            for p in group["params"]:
                master.append(p)
                grads.append(p.grad)
        for state in getattr(opt, "state", {}).values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    found["gradients"] = _bytes(grads, seen)
    found["optimizer"] = _bytes(opt_tensors, seen) + _bytes(master, seen)  # master copies not counted above
    return found


def rss_peak() -> int:
    """This process's peak RSS (VmHWM; `ru_maxrss` would carry a larger parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(config: str, result: str) -> int:
    import torch

    from vlrft.config import load_config
    from vlrft.plan import Hardware, plan_for_config, strategy_from_config
    from vlrft.trainer.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(config, validate=False)
    trainer = Trainer(cfg)
    loading_peak = rss_peak()
    model = trainer.strategy.unwrap(trainer.wrapped)
    measured: dict = {}

    def at_step(optimizer, *_):
        if not measured:
            measured.update(measure_state(model, trainer.optimizer))
            measured["rss_at_step"] = rss_now()

    hooks = [opt.register_step_post_hook(at_step) for opt in _torch_optimizers(trainer.optimizer)
             if hasattr(opt, "register_step_post_hook")]
    trainer.train_step()
    for hook in hooks:
        hook.remove()
    world = trainer.strategy.world_size
    plan = plan_for_config(cfg, Hardware(gpus_per_node=world, nodes=1, gpu_memory=1 << 40),
                           strategy_from_config(cfg, mixed_precision=False))
    row = {"rank": trainer.strategy.rank, **measured, "loading_rss_peak": loading_peak, "rss_peak": rss_peak(),
           "plan": {k: plan.component(k) for k in ("parameters", "gradients", "optimizer", "buffers")},
           "parameter_count": plan.parameters}
    rows = trainer.strategy.all_gather_object(row)
    if trainer.strategy.is_main:
        Path(result).write_text(json.dumps({"strategy": cfg.train.strategy, "world_size": world, "ranks": rows}))
    trainer.strategy.close()
    return 0


# ------------------------------------------------------------------ the driver


def known_strategies() -> tuple[str, ...]:
    from vlrft.parallel import strategy as module

    return tuple(getattr(module, "STRATEGIES", ("single", "ddp")))


def run(config: Path, ranks: int, timeout: int) -> dict | None:
    result = config.with_suffix(".result.json")
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(Path(__file__).resolve()), "--worker", str(config), "--result", str(result)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not result.is_file():
        print(f"{config.name}: failed (exit {done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(result.read_text())


def report(results: list[dict]) -> str:
    lines = [f"{'strategy':<10}{'rank':>5}{'params':>9}{'grads':>9}{'optim':>9}{'p+g+o':>9}{'plan p+g+o':>12}"
             f"{'error':>8}{'load RSS':>10}{'peak RSS':>10}   (MiB)"]
    for r in results:
        for row in r["ranks"]:
            measured = row["parameters"] + row["gradients"] + row["optimizer"]
            plan = row["plan"]["parameters"] + row["plan"]["gradients"] + row["plan"]["optimizer"]
            lines.append(f"{r['strategy']:<10}{row['rank']:>5}{row['parameters'] / MIB:>9.0f}"
                         f"{row['gradients'] / MIB:>9.0f}{row['optimizer'] / MIB:>9.0f}{measured / MIB:>9.0f}"
                         f"{plan / MIB:>12.0f}{100 * (plan - measured) / measured:>7.1f}%"
                         f"{row['loading_rss_peak'] / MIB:>10.0f}{row['rss_peak'] / MIB:>10.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,fsdp2,deepspeed")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_memory")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--micro-batch", type=int, default=4, help="completions per forward/backward (4 per rank "
                        "in all: 4 = one micro-batch, 1 = four, with gradients accumulated over them)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.result)
    folder = (REPO / args.out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model(folder / "model")
    known, results = known_strategies(), []
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        if strategy not in known:
            print(f"{strategy}: skipped (make_strategy in this checkout knows {', '.join(known)})")
            continue
        start = time.perf_counter()
        out = run(write_config(folder, model, strategy, args.micro_batch), args.ranks, args.timeout)
        if out is not None:
            out["wall_s"] = round(time.perf_counter() - start, 1)
            results.append(out)
    if results:
        count = results[0]["ranks"][0]["parameter_count"]
        print(f"model: {count / 1e6:.1f} M parameters, {args.ranks} ranks (gloo, CPU, float32)")
        print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Rank 0's host memory while a sharded (FSDP2, ZeRO-3) policy is written in Hugging Face format: vlrft's
streamed export against the whole-state-dict save that accelerate-based trainers (and vlrft before it) use.

    python bench/bench_checkpoint_memory.py [--strategy fsdp2|deepspeed] [--layers 24] [--hidden 2048] [--repeats 2]

A random Qwen2.5-VL-shaped model (float32; the defaults give about 1.0 B parameters, 4 GB, so more than one
of vlrft's 2 GiB shard files) is loaded under `torchrun --nproc_per_node 2` (gloo, CPU) with vlrft's FSDP2 or
DeepSpeed ZeRO-3 strategy, then written to `model/` in one of two ways, each run in its own torchrun, interleaved:

- `vlrft`: `vlrft.parallel.hf_export.save_gathered`, what a vlrft checkpoint does: every rank gathers one
  bucket (at most 2 GiB) at a time and rank 0 writes it as a shard file;
- `whole state dict`: every weight gathered into rank 0's memory, then `save_pretrained(state_dict=...)`:
  FSDP2 `get_model_state_dict(full_state_dict=True, cpu_offload=True)`, as TRL/accelerate and verl do;
  ZeRO-3 `engine._zero3_consolidated_16bit_state_dict()`, what accelerate's `get_state_dict` calls.

Measured on every rank: the RSS just before saving (after `gc.collect()` and `malloc_trim`, so memory freed
while loading does not hide the save's own), and the peak RSS during the save (VmHWM, reset through
`/proc/self/clear_refs` just before); the figure to read is rank 0's peak minus its RSS before. Both outputs
are checked to hold the same tensor names and bytes. Needs about 3x the model's size in free host memory.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MIB = 1 << 20
METHODS = ("vlrft", "whole state dict")


def build_model(out: Path, hidden: int, layers: int) -> Path:
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    if not (out / "config.json").is_file():
        build_tiny_vlm(out, TinySpec(arch="qwen2_5_vl", hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                     num_layers=layers, num_heads=16, num_kv_heads=2, vision_depth=2,
                                     vision_hidden_size=128, vision_heads=2, vocab_size=512))
    return out


# ------------------------------------------------------------------ one torchrun: load, then save one way


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: VmHWM starts again from the current RSS


def release_freed_memory() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def save_whole_state_dict(root, hf_model, processor, folder: Path, is_main: bool) -> None:
    """The usual way: the full state dict gathered into rank 0's host memory, then `save_pretrained`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if hasattr(root, "_zero3_consolidated_16bit_state_dict"):  # a DeepSpeed engine
        full = root._zero3_consolidated_16bit_state_dict()
    else:
        full = get_model_state_dict(hf_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        hf_model.save_pretrained(folder, state_dict=full, safe_serialization=True)
        processor.save_pretrained(folder)


def worker(strategy_name: str, model_dir: str, method: str, out_dir: str, result: str) -> int:
    import torch
    from transformers import AutoProcessor

    from vlrft.parallel.hf_export import save_gathered
    from vlrft.parallel.strategy import ModelSource, rank_info_from_env
    from vlrft.models.weights import policy_module

    torch.set_num_threads(1)
    if strategy_name == "deepspeed":
        from vlrft.parallel.deepspeed import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(rank_info_from_env(), None)  # ZeRO-3, float32
    else:
        from vlrft.parallel.fsdp2 import FSDP2Strategy

        strategy = FSDP2Strategy(rank_info_from_env(), None)
    model = strategy.load_model(ModelSource(model_dir), trainable=True)
    root, _ = strategy.prepare_trainable(model, lambda params: torch.optim.AdamW(params, lr=0.0))  # never stepped: no state
    hf_model = policy_module(strategy.unwrap(root))
    processor = AutoProcessor.from_pretrained(model_dir)
    folder = Path(out_dir)
    release_freed_memory()
    strategy.barrier()
    before = rss_now()
    reset_rss_peak()
    start = time.perf_counter()
    if method == "vlrft":
        save_gathered(hf_model, processor, folder, is_main=strategy.is_main, gather=strategy.gathered)
    else:
        save_whole_state_dict(root, hf_model, processor, folder, strategy.is_main)
    strategy.barrier()
    row = {"rank": strategy.rank, "rss_before": before, "rss_peak": rss_peak(),
           "seconds": time.perf_counter() - start}
    rows = strategy.all_gather_object(row)
    if strategy.is_main:
        Path(result).write_text(json.dumps({"method": method, "ranks": rows}))
    strategy.close()
    return 0


# ------------------------------------------------------------------ the driver


def run(strategy: str, model: Path, method: str, out: Path, timeout: int) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    result = out.with_suffix(".json")
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "--worker", strategy, "--model", str(model), "--method", method, "--save-to", str(out),
           "--result", str(result)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not result.is_file():
        raise SystemExit(f"{method}: failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def saved_tensors(folder: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """name -> (dtype, shape, a digest of the bytes) of every tensor in a Hugging Face folder."""
    import hashlib

    import torch
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                digest = hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy()).digest()
                found[name] = (str(t.dtype), tuple(t.shape), digest)
    return found


def summary(values: list[float]) -> str:
    return f"{min(values):.0f}/{statistics.median(values):.0f}/{max(values):.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("fsdp2", "deepspeed"), default="fsdp2")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_checkpoint_memory")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-to", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.model, args.method, args.save_to, args.result)
    folder = (REPO / args.out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model(folder / f"model_h{args.hidden}_l{args.layers}", args.hidden, args.layers)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    rows: dict[str, list[dict]] = {m: [] for m in METHODS}
    for repeat in range(args.repeats):
        for method in METHODS:  # interleaved: vlrft, whole, vlrft, whole, ...
            out = folder / f"saved_{method.replace(' ', '_')}"
            rows[method].append(run(args.strategy, model, method, out, args.timeout))
            r0 = rows[method][-1]["ranks"][0]
            print(f"repeat {repeat + 1}, {method}: rank 0 +{(r0['rss_peak'] - r0['rss_before']) / MIB:.0f} MiB "
                  f"over {r0['rss_before'] / MIB:.0f} MiB, {r0['seconds']:.1f} s", flush=True)
    ours, theirs = (saved_tensors(folder / f"saved_{m.replace(' ', '_')}") for m in METHODS)
    same = ours == theirs
    print(f"\nmodel: {weights / MIB:.0f} MiB of float32 weights ({model.name}); 2 ranks, {args.strategy}, gloo, CPU; "
          f"min/median/max over {args.repeats} interleaved runs each")
    print(f"saved tensors identical in both folders: {same} ({len(ours)} tensors)")
    print(f"{'method':<18}{'rank':>5}{'RSS before':>16}{'peak during save':>18}{'added by the save':>19}"
          f"{'seconds':>10}   (MiB)")
    for method in METHODS:
        for rank in (0, 1):
            runs = [r["ranks"][rank] for r in rows[method]]
            print(f"{method:<18}{rank:>5}{summary([r['rss_before'] / MIB for r in runs]):>16}"
                  f"{summary([r['rss_peak'] / MIB for r in runs]):>18}"
                  f"{summary([(r['rss_peak'] - r['rss_before']) / MIB for r in runs]):>19}"
                  f"{statistics.median(r['seconds'] for r in runs):>10.1f}")
    added = {m: statistics.median((r["ranks"][0]["rss_peak"] - r["ranks"][0]["rss_before"]) for r in rows[m])
             for m in METHODS}
    print(f"rank 0's added memory, vlrft / whole state dict: {added['vlrft'] / added['whole state dict']:.2f} "
          f"(model {weights / MIB:.0f} MiB)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

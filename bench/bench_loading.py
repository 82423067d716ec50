#!/usr/bin/env python
"""Host memory while loading the policy under each strategy, per rank (CPU, gloo, 2 processes).

    PYTHONPATH=. python bench/bench_loading.py [--strategies ddp fsdp2 fsdp2_read_f32 zero2 zero3] [--hidden 1024]
                                               [--layers 12] [--nproc 2] [--checkpoint-dtype bfloat16] [--repeats 3]

Builds a random Qwen2-VL-shaped model (tiny vocabulary, real layer shapes) once, then for each strategy
launches `torchrun` and reports each rank's peak RSS above its RSS after imports, after loading the policy
and after preparing it for training (optimizer created, no step taken), and how many parameters the rank
holds. Under DDP and ZeRO-2 every rank reads the whole checkpoint; under FSDP2 rank 0 reads it and the
others build on the meta device and receive only their shards; ZeRO-3 builds the model inside
`deepspeed.zero.Init` (rank 0 reads the checkpoint, every rank keeps its partition). Under FSDP2 rank 0 reads
a bfloat16 checkpoint in bfloat16 (`--checkpoint-dtype bfloat16`; `fsdp2_read_f32` is the same load reading it
in float32).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = {"ddp": [], "fsdp2": [], "fsdp2_read_f32": [], "zero2": ["train.deepspeed.zero_stage=2"],
              "zero3": ["train.deepspeed.zero_stage=3"]}  # name -> config overrides
# fsdp2_read_f32: the peer of fsdp2 for a bfloat16 checkpoint, rank 0 reading it in float32 (the training dtype),
# as vlrft did before and as trainers that load the policy in float32 on rank 0 do.


def local_numel(p) -> int:
    """Elements of a parameter this rank holds: a DTensor's shard (FSDP2), a ZeRO-3 partition, else all."""
    if hasattr(p, "to_local"):
        return p.to_local().numel()
    return p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()


def worker(name: str, model_dir: str, out: str) -> None:
    import resource

    import torch

    from vlrft.config import load_config
    from vlrft.parallel import make_strategy
    from vlrft.parallel.strategy import ModelSource

    kind = "deepspeed" if name.startswith("zero") else name.removesuffix("_read_f32")
    if name.endswith("_read_f32"):
        import vlrft.parallel.fsdp2

        vlrft.parallel.fsdp2._read_dtype = lambda source, config: source.dtype
    cfg = load_config(None, [f"train.strategy={kind}", *STRATEGIES[name]], validate=False)
    strategy = make_strategy(kind, cfg)
    # Import what loading imports first, so the figure is memory for weights, not for code.
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import transformers.models.qwen2_vl.modeling_qwen2_vl  # noqa: F401
    from transformers import AutoModelForImageTextToText  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = strategy.load_model(ModelSource(model_dir), trainable=True)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wrapped, _ = strategy.prepare_trainable(model, lambda params: torch.optim.AdamW(params, lr=1e-5))
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    local = sum(local_numel(p) for p in wrapped.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = strategy.all_gather_object({"rank": strategy.rank, "peak_mib_above_imports": (peak - before) / 1024,
                                       "load_peak_mib_above_imports": (loaded - before) / 1024,
                                       "local_params": local, "params": params})
    if strategy.is_main:
        Path(out).write_text(json.dumps(rows))
    strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategies", nargs="+", choices=sorted(STRATEGIES), default=list(STRATEGIES))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--checkpoint-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the dtype the checkpoint is saved in (Qwen releases: bfloat16); training is float32")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each strategy, interleaved")
    args = parser.parse_args()
    from vlrft.models.tiny import TinySpec, build_tiny_vlm

    folder = Path(tempfile.mkdtemp(prefix="bench_loading_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # gigabytes of checkpoint
    spec = TinySpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=16, num_kv_heads=4,
                    intermediate_size=args.hidden * 11 // 4, vision_depth=4, vision_hidden_size=512, vision_heads=8)
    model_dir = build_tiny_vlm(folder / "model", spec)
    if args.checkpoint_dtype != "float32":
        from vlrft.models.loading import load_policy

        model = load_policy(model_dir, dtype=args.checkpoint_dtype)
        for weights in [*model_dir.glob("*.safetensors"), *model_dir.glob("*.safetensors.index.json")]:
            weights.unlink()
        model.save_pretrained(model_dir)
        del model
    size_mib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    print(f"checkpoint: {size_mib:.0f} MiB ({args.checkpoint_dtype})")
    for name in [n for _ in range(args.repeats) for n in args.strategies]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = folder / f"{name}.json"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.setdefault("DS_ACCELERATOR", "cpu")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                        "--master_addr", "127.0.0.1", "--master_port", str(port), __file__, "--worker", name,
                        str(model_dir), str(out)], env=env, check=True, capture_output=True)
        for row in sorted(json.loads(out.read_text()), key=lambda r: r["rank"]):
            print(f"{name:6s} rank {row['rank']}: peak RSS +{row['load_peak_mib_above_imports']:.0f} MiB after "
                  f"loading, +{row['peak_mib_above_imports']:.0f} MiB prepared for training, "
                  f"holds {row['local_params'] / 1e6:.1f} M of {row['params'] / 1e6:.1f} M parameters")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()

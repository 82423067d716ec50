#!/usr/bin/env python
"""The completion pass's waiting gradients under DeepSpeed ZeRO-3 (or 2), counted on 2 CPU ranks (gloo).

    DS_ACCELERATOR=cpu python bench/bench_plan_zero3.py [--stage 2]

As bench/bench_plan_fsdp2.py, with the tiny model wrapped by `deepspeed.initialize` at ZeRO stage 3 (float32
weights and gradients, as vlrft runs it; a small reduce bucket instead of DeepSpeed's 5e8 elements, which is not
what is measured here): one shared-prompt micro-batch's `ActorVL` forward and backward after one unmeasured, the
live storages at the peak split into `gathered` (what ZeRO-3's parameter fetches allocate), `pending_grads` (the
completion pass's gradient of each parameter both passes use, waiting for the prompt pass's), `unsharded_grads`
(the other whole gradients) and the rest. Prints each beside the language model's trained parameters in float32
(`pending_most`: all of the waiting gradients at once).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_plan_terms import Case, LiveStorages, _batch, _model, _tag_gradients  # noqa: E402

WORLD = 2


@contextlib.contextmanager
def _tagging_fetches(meter: LiveStorages):
    """What ZeRO-3's parameter fetches make, tagged `gathered`."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    fetch = PartitionedParameterCoordinator.fetch_sub_module

    def fetching(self, *args, **kwargs):
        before, meter.context = meter.context, "gathered"
        try:
            return fetch(self, *args, **kwargs)
        finally:
            meter.context = before

    PartitionedParameterCoordinator.fetch_sub_module = fetching
    try:
        yield
    finally:
        PartitionedParameterCoordinator.fetch_sub_module = fetch


def measure_zero3(case: Case, stage: int = 3) -> dict[str, int]:
    """Rank 0's live-storage split for `case` at ZeRO `stage`, with the plan's `pending_most` beside it."""
    import deepspeed

    import vlrft.models.actor as actor_module

    model, actor, tokenizer = _model(case)
    seqs = _batch(case, model, tokenizer)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 1 << 20, "allgather_bucket_size": 1 << 20,
                                    "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0},
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2 ** 62}
    engine, *_ = deepspeed.initialize(model=actor, optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-6),
                                      config=config)

    def forward():
        return engine(seqs).logprobs

    engine.backward(forward().sum())  # the lazy state, and the gradient partitions as from an earlier micro-batch
    meter = LiveStorages()
    recorded, making = [], actor_module.recording_cache

    def recording():
        cache = making()
        recorded.append(cache)
        return cache

    actor_module.recording_cache = recording
    try:
        with meter, _tagging_fetches(meter):
            logprobs = forward()
            records = [record for cache in recorded for layer in cache.layers for record in (layer.keys, layer.values)]
            _tag_gradients(meter, logprobs, records, others="unsharded_grads")
            del recorded[:], records
            engine.backward(logprobs.sum())
            del logprobs
    finally:
        actor_module.recording_cache = making
    peak, split = meter.peak_breakdown()
    from vlrft.plan import shape_from_config
    from vlrft.plan.activations import shared_gradients

    shape = shape_from_config(model.config.to_dict())
    return {**split, "peak": peak, "pending_most": meter.most_alive({"pending_grads"}),
            "gathered_most": meter.most_alive({"gathered"}),
            "planned_pending_most": shared_gradients(shape, 4, 4).total(shape.text.num_layers)}


def _rank(rank: int, store: str, cases: list[Case], stage: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        results = [measure_zero3(case, stage) for case in cases]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run_cases(cases: list[Case], stage: int = 3) -> list[dict[str, int]]:
    """`measure_zero3` of each case on rank 0 of a 2-process gloo group (DeepSpeed's CPU accelerator)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory() as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "out.json")
        mp.spawn(_rank, args=(store, cases, stage, out), nprocs=WORLD, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=3, choices=(2, 3), help="ZeRO stage")
    stage = parser.parse_args().stage
    cases = [Case(mixed=False), Case(layers=8, mixed=False)]
    for case, result in zip(cases, run_cases(cases, stage)):
        print(case.describe(), {k: round(v / 2 ** 20, 3) for k, v in result.items()})
        print(f"  pending_most / planned: {result['pending_most'] / result['planned_pending_most']:.2f}, "
              f"at the peak: {result.get('pending_grads', 0) / result['planned_pending_most']:.2f}")


if __name__ == "__main__":
    main()

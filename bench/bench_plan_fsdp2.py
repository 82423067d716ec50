#!/usr/bin/env python
"""The memory plan's FSDP2 terms against the tensors a 2-rank FSDP2 run really keeps alive, counted on the CPU.

    python bench/bench_plan_fsdp2.py [--quick]

Two processes (torch.multiprocessing, gloo) shard a random tiny Qwen2.5-VL model (`vlrft.models.tiny`) as
`vlrft.parallel.fsdp2` does (`fully_shard` per decoder layer and vision block, then the `ActorVL` root; with bf16
cases FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)` and the trainer's bf16 autocast, which
gloo carries on CPU like `VLRFT_CPU_MIXED_PRECISION=1` runs) and run one micro-batch of the shared-prompt forward
(`ActorVL.forward`, the completions' logprobs) and the backward of their sum, after one such step unmeasured (FSDP2's
lazy state, the sharded gradients of an earlier micro-batch). Live storages are counted as bench/bench_plan_terms.py
counts them (`LiveStorages`), and at the peak of forward + backward split into:

- `gathered`: the all-gathered (unsharded) parameters alive (FSDP2 resizes their storages in place; counted when it
  allocates and frees them);
- `pending_grads`: the completion pass's unsharded gradient of each parameter both passes use, waiting in autograd's
  buffer for the prompt pass's (in a one-graph backward; the trainer's FSDP2 runs it in stages, where none waits:
  `vlrft.models.staged_backward`, the cases marked `staged`);
- `unsharded_grads`: the other unsharded gradients (`.grad` of the gathered parameters until their reduce-scatter);
- `fsdp_comm`: FSDP2's all-gather and reduce-scatter buffers;
- `prompt_kv`, `activations`: as in bench/bench_plan_terms.py (`activations` here also holds the LM head's logits).

Prints, per case, each part beside the plan's term for it (`gathered_layers`: the gathered parameters, gradients and
buffers; `pending_grads`: the shared parameters' gradients in the compute dtype) and the ratio; a summary of the
ratios, which docs/memory_plan.md quotes. `tests/test_plan_terms.py` checks one case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_plan_terms import (Case, LiveStorages, _batch, _model, _tag_gradients,  # noqa: E402
                                    tagged_prompt_kv)

WORLD = 2


def _fsdp_params(root) -> list:
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in root.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            found += group.fsdp_params if group is not None else []
    return found


@contextlib.contextmanager
def _counting_fsdp(meter: LiveStorages, root):
    """FSDP2's gathered parameters counted as they are allocated and freed (tagged `gathered`), and what its
    collectives make tagged `fsdp_comm`."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    gathered = [t for p in _fsdp_params(root) for t in [*p.all_gather_outputs, *p._unsharded_inner_tensors]]
    for tensor in gathered:
        meter.exclude(tensor.untyped_storage())
        meter.made(tensor.untyped_storage()._cdata, tensor.untyped_storage().nbytes(), "gathered")
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    gather, reduce = _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce

    def allocating(tensor):
        alloc(tensor)
        meter.exclude(tensor.untyped_storage())
        meter.made(tensor.untyped_storage()._cdata, tensor.untyped_storage().nbytes(), "gathered")

    def freeing(tensor):
        meter.released(tensor.untyped_storage()._cdata)
        free(tensor)

    def communicating(func):
        def run(*args, **kwargs):
            before, meter.context = meter.context, "fsdp_comm"
            try:
                return func(*args, **kwargs)
            finally:
                meter.context = before
        return run

    patches = [(_fsdp_param, "alloc_storage", allocating), (_fsdp_param_group, "alloc_storage", allocating),
               (_fsdp_param, "free_storage", freeing), (_fsdp_param_group, "foreach_all_gather", communicating(gather)),
               (_fsdp_param_group, "foreach_reduce", communicating(reduce))]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _sharded(case: Case):
    """The case's model sharded as `vlrft.parallel.fsdp2.FSDP2Strategy._shard` shards it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from vlrft.parallel.fsdp2 import shard_units

    model, actor, tokenizer = _model(case)
    options: dict = dict(mesh=init_device_mesh("cpu", (WORLD,)), reshard_after_forward=True)
    if case.mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in shard_units(actor):
        fully_shard(unit, **options)
    fully_shard(actor, **options)
    return model, actor, tokenizer


def measure_fsdp2(case: Case) -> tuple[dict[str, int], dict[str, int]]:
    """(measured, planned) bytes of one rank's FSDP2 terms for one micro-batch (in a 2-rank process group)."""
    model, actor, tokenizer = _sharded(case)
    seqs = _batch(case, model, tokenizer)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.mixed, cache_enabled=not case.checkpointing):
            return actor(seqs).logprobs

    forward().sum().backward()  # FSDP2's lazy state, and the sharded gradients as from an earlier micro-batch
    local = [t for p in actor.parameters() for t in (p, p.grad) if t is not None]
    meter = LiveStorages(ignored=[t.to_local() if hasattr(t, "to_local") else t for t in local])
    with meter, _counting_fsdp(meter, actor), tagged_prompt_kv(meter) as tag_prompt_kv:
        logprobs = forward()
        records = tag_prompt_kv()
        _tag_gradients(meter, logprobs, records, others="unsharded_grads")
        del records
        logprobs.sum().backward()
        del logprobs
    peak, split = meter.peak_breakdown()
    gathered_parts = ("gathered", "unsharded_grads", "fsdp_comm")
    measured = {part: split.get(part, 0) for part in (*gathered_parts, "pending_grads", "activations")}
    measured.update(peak=peak, prompt_kv=meter.most_alive({"prompt_kv"}),
                    gathered_layers=sum(split.get(part, 0) for part in gathered_parts),
                    gathered_layers_most=meter.most_alive(set(gathered_parts)),
                    pending_most=meter.most_alive({"pending_grads"}))
    return measured, planned_fsdp2(case, model)


def planned_fsdp2(case: Case, model) -> dict[str, int]:
    """The plan's figures for the case's micro-batch under `fsdp2` on 2 ranks: its terms (`activations` with the
    logits beside it, as measured), and `pending_most`, all the waiting gradients at once."""
    from vlrft.plan import shape_from_config
    from vlrft.plan.activations import MicroBatchSize, SharedGradients, logits_bytes, micro_batch_terms, shared_gradients
    from vlrft.plan.memory_plan import StrategyChoice
    from vlrft.plan.model_state import model_state

    shape = shape_from_config(model.config.to_dict())
    hi = 2 if case.mixed else 4
    params = shape.num_parameters
    gathered = model_state(params, params, shape, StrategyChoice("fsdp2", mixed_precision=case.mixed), WORLD).gathered
    rows = case.prompts * case.rows_per_prompt
    batch = MicroBatchSize(case.prompts * case.prompt_len + rows * case.completion_len,
                           case.prompts * case.image_grid ** 2, rows, case.prompts * case.prompt_len,
                           rows * case.completion_len, "")
    # unsharded gradients in FSDP2's param_dtype; none wait in a staged backward
    shared = SharedGradients() if case.stages else shared_gradients(shape, hi, hi)
    terms = micro_batch_terms(shape, batch, case.prompt_len, case.completion_len, case.checkpointing, hi,
                              float32_weights=False, shared=shared)
    return {"gathered_layers": gathered, "gathered_layers_most": gathered,
            "pending_grads": terms.get("pending_grads", 0), "pending_most": shared.total(shape.text.num_layers),
            "prompt_kv": terms["prompt_kv"],
            "activations": terms["activations"] + logits_bytes(shape, batch.completion_tokens)}


def _rank(rank: int, store: str, cases: list[Case], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        results = [measure_fsdp2(case) for case in cases]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run_cases(cases: list[Case]) -> list[tuple[dict[str, int], dict[str, int]]]:
    """(measured, planned) of each case, from rank 0 of a 2-process gloo group."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "out.json")
        mp.spawn(_rank, args=(store, cases, out), nprocs=WORLD, join=True)
        return [tuple(pair) for pair in json.loads(Path(out).read_text())]


def grid(quick: bool) -> list[Case]:
    base = [Case()]
    if not quick:
        base += [Case(layers=8), Case(hidden=256, heads=8, kv_heads=2), Case(prompt_len=128, completion_len=128)]
    return [Case(**{**c.__dict__, "checkpointing": ckpt, "mixed": mixed, "stages": stages})
            for c in base for ckpt in (True, False) for mixed in (True, False) for stages in (True, False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one micro-batch shape (8 cases)")
    args = parser.parse_args()
    cases = grid(args.quick)
    ratios: dict[str, list[float]] = {}
    print(f"{'case':68s} {'part':16s} {'measured MiB':>12s} {'planned MiB':>12s} {'ratio':>6s}")
    for case, (measured, planned) in zip(cases, run_cases(cases)):
        for part, value in measured.items():
            plan = planned.get(part)
            ratio = f"{value / plan:6.2f}" if plan else ""
            if plan:
                ratios.setdefault(part, []).append(value / plan)
            plan_text = f"{plan / 2 ** 20:12.3f}" if plan is not None else ""
            print(f"{case.describe():68s} {part:16s} {value / 2 ** 20:12.3f} {plan_text:>12s} {ratio}")
    print("\npart            measured / planned (min - max over the grid)")
    for part, values in ratios.items():
        print(f"{part:15s} {min(values):.2f} - {max(values):.2f} ({len(values)} cases)")


if __name__ == "__main__":
    main()

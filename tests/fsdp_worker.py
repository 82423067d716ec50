"""Run under torchrun by tests/test_fsdp2.py and tests/test_deepspeed.py (any sharding strategy).

`python fsdp_worker.py PLAN.json` runs the trainings a plan lists one after another in the same
processes (one FSDP2 strategy, one process group), each with the `ScriptedEngine` test double
unless the run says `"scripted": false` (then the configured engine), and rank 0 writes the
plan's "out" file: each run's metric history; a run with "sync_out" also saves what a weight sync
from the shards sent; one with "watch_gradients" records whether each backward left every trained parameter
with its reduced gradient shard. `python fsdp_worker.py fail` has rank 1
raise while rank 0 waits in a collective.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from scripted_engine import RecordingEngine, use_scripted_engine  # noqa: E402

from vlrft.config import load_config  # noqa: E402
from vlrft.parallel.process_exit import exit_process  # noqa: E402
from vlrft.parallel import make_strategy  # noqa: E402
from vlrft.errors import UserError  # noqa: E402
from vlrft.models.weights import PolicyWeights  # noqa: E402


def sync_weights(trainer, out: Path) -> None:
    """Every rank walks the buckets (gathering is collective); each records what it would send, in float32 and
    in bfloat16 (with the dtypes FSDP2's `full_tensor()` gathered in, and the devices it gathered on)."""
    from torch.distributed.tensor import DTensor

    engine = RecordingEngine()
    for bucket in PolicyWeights(trainer.actor, torch.float32, trainer.strategy.gathered).buckets(1 << 16, "cpu"):
        engine.load(bucket)
    gathered_dtypes, gathered_devices = set(), set()
    full_tensor = DTensor.full_tensor

    def recording(self, *args, **kwargs):
        gathered_dtypes.add(str(self.dtype))
        gathered_devices.add(self.device.type)
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = recording
    try:
        bf16 = {name: t for bucket in PolicyWeights(trainer.actor, torch.bfloat16, trainer.strategy.gathered)
                .buckets(1 << 16, "cpu") for name, t in bucket}
    finally:
        DTensor.full_tensor = full_tensor
    if trainer.strategy.is_main:
        torch.save({"received": engine.received, "duplicates": engine.duplicates, "received_bf16": bf16,
                    "gathered_dtypes_bf16": sorted(gathered_dtypes), "gathered_devices_bf16": sorted(gathered_devices)},
                   out)


def _count_lean_decode_steps() -> list[int]:
    """Counts the hf engine's lean decode steps (vlrft.decoding.lean), to show which decode path a run took."""
    from vlrft.decoding.lean import LeanDecoder

    counter = [0]
    step = LeanDecoder.step

    def counted(self, tokens, index):
        counter[0] += 1
        return step(self, tokens, index)

    LeanDecoder.step = counted
    return counter


def watch_gradients(strategy) -> list[bool]:
    """After each backward, whether every trained parameter holds its reduced shard of the gradient (a sharded
    gradient as big as its parameter's shard), i.e. nothing waits unreduced on unsharded parameters."""
    from torch.distributed.tensor import DTensor

    sharded_after_each: list[bool] = []
    backward = strategy.backward

    def watched(loss, module):
        backward(loss, module)
        trained = [p for p in module.parameters() if p.requires_grad]
        sharded_after_each.append(bool(trained) and all(
            isinstance(p, DTensor) and isinstance(p.grad, DTensor)
            and p.grad.to_local().numel() == p.to_local().numel() for p in trained))

    strategy.backward = watched
    return sharded_after_each


def watch_loads(strategy) -> list[tuple[int, list[str]]]:
    """For each model this rank loads: (bytes of its parameters that hold data, the devices of those) as
    `load_model` returns it, before any sharding."""
    loads: list[tuple[int, list[str]]] = []
    load_model = strategy.load_model

    def watched(source, **kwargs):
        model = load_model(source, **kwargs)
        real = [p for p in model.parameters() if not p.is_meta]
        loads.append((sum(p.numel() * p.element_size() for p in real), sorted({p.device.type for p in real})))
        return model

    strategy.load_model = watched
    return loads


def _resharded(model) -> bool | None:
    """Whether every parameter of a frozen model is back to its shard (None: no such model). FSDP2 swaps a module's
    parameters for whole tensors while they are gathered; the root (embeddings, LM head) is the one FSDP2 may
    keep gathered after a forward, and a frozen model runs no backward that would reshard it."""
    if model is None:
        return None
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def run_plan(plan_file: str) -> None:
    from vlrft.trainer import Trainer

    import vlrft.trainer.trainer as trainer_module

    plan = json.loads(Path(plan_file).read_text())
    configured_engine = trainer_module.make_engine
    strategy = None
    results = []
    lean_steps = _count_lean_decode_steps()
    for run in plan["runs"]:
        lean_steps[0] = 0
        trainer_module.make_engine = configured_engine
        if run.get("scripted", True):
            use_scripted_engine()
        # "{rank}" in an override: a value of each rank's own (e.g. a folder per rank, as node-local disks give)
        overrides = [o.replace("{rank}", os.environ.get("RANK", "0")) for o in run.get("overrides", [])]
        cfg = load_config(run["config"], overrides, validate=False)
        if strategy is None or run.get("new_strategy"):  # a run with other strategy options builds its own
            strategy = make_strategy(cfg.train.strategy, cfg)
        sharded_grads = watch_gradients(strategy) if run.get("watch_gradients") else None
        loads = watch_loads(strategy) if run.get("watch_loads") else None
        try:
            trainer = Trainer(cfg, strategy)
            history = trainer.fit()
        except UserError as exc:  # a run expected to be refused: every rank raises it together
            results.append({"error": str(exc), "traceback": traceback.format_exc()})  # where, if it was not expected
            continue
        finally:
            if sharded_grads is not None:
                del strategy.backward  # unwatched for the next run
            if loads is not None:
                del strategy.load_model
        if run.get("sync_out"):
            sync_weights(trainer, Path(run["sync_out"]))
        results.append({"history": history, "world_size": strategy.world_size, "lean_decode_steps": lean_steps[0],
                        "gradients_sharded_after_each_backward": sharded_grads,
                        "reference_resharded": _resharded(trainer.ref),
                        "loads_per_rank": strategy.all_gather_object(loads) if loads is not None else None,
                        "engine_calls_before_first_generate": trainer.engine.calls_before_first_generate()
                        if hasattr(trainer.engine, "calls_before_first_generate") else None})
    if strategy.is_main:
        Path(plan["out"]).write_text(json.dumps(results))
    strategy.close()


def load(folder: str, out: str) -> None:
    """Load `folder` as the float32 policy under FSDP2; rank 0 saves the gathered weights and buffers, and the dtype
    it read the checkpoint in."""
    import vlrft.models.loading as loading
    from vlrft.parallel.strategy import ModelSource

    read = []
    load_policy = loading.load_policy
    loading.load_policy = lambda *args, **kwargs: read.append(kwargs["dtype"]) or load_policy(*args, **kwargs)
    strategy = make_strategy("fsdp2")
    model = strategy.load_model(ModelSource(folder, "float32"), trainable=True)
    root, _ = strategy.prepare_trainable(model, lambda params: torch.optim.AdamW(params, lr=0.0))
    params = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
              for name, p in root.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in root.named_buffers()}
    if strategy.is_main:
        torch.save({"params": params, "buffers": buffers, "read": read}, out)
    strategy.close()


def fail() -> None:
    import torch.distributed as dist

    strategy = make_strategy("fsdp2")
    if strategy.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 would wait here forever without torchrun ending the job
    strategy.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "fail":
        fail()
    elif sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    else:
        run_plan(sys.argv[1])
    exit_process(0)  # as `vlrft train` does under torchrun: no interpreter teardown after the run

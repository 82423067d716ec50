"""Worker for the SGLang tensor-parallel weight-sync test: two real processes (gloo), one stand-in engine.

Every rank holds the policy and packs each bucket "from its own GPU" (here: a string naming the
rank and the weight); the leader's `RecordingSGLangEngine` records what SGLang would receive.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from vlrft.parallel.process_exit import exit_process
from vlrft.rollout.colocate import ColocatedEngine, EngineOptions, GroupComm, RankLayout
from vlrft.tokens import TokenSpec
from vlrft.rollout.outputs import EngineError
from vlrft.rollout.sglang import SGLangBackend


@dataclass
class StandInLocalSerializedTensor:
    """Stand-in for sglang's LocalSerializedTensor: `values[k]` is TP rank k's payload."""

    values: list


class RecordingSGLangEngine:
    """Stand-in for `sglang.Engine` (the weight-update calls only); records them, answers like SGLang 0.5.23."""

    def __init__(self):
        self.calls: list = []
        self.fail_update: str | None = None

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append("begin_weight_update")
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end_weight_update")
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append({name: list(t.values) for name, t in named_tensors})
        return (False, self.fail_update) if self.fail_update else (True, "Success")

    def flush_cache(self):
        self.calls.append("flush_cache")
        return type("FlushCacheReqOutput", (), {"success": True, "message": ""})()


def worker(rank: int, out_dir: str, model_dir: str, fail_update: str) -> None:
    """Syncs twice: once normally, once with the engine refusing the update (message `fail_update`)."""
    from vlrft.models.loading import load_policy

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    layout = RankLayout(rank, 2, 2)
    model = load_policy(model_dir)
    recorder = RecordingSGLangEngine() if layout.is_leader else None
    tokens = TokenSpec(pad_id=0, eos_ids=(2,), image_token_id=6, video_token_id=7)
    backend = SGLangBackend(recorder, tokens, local_tensor=StandInLocalSerializedTensor,
                            tags=("weights", "kv_cache")) if recorder else None  # no sglang import needed
    engine = ColocatedEngine(backend, lambda batch: [], layout, GroupComm(layout), lambda: model, None, tokens,
                             EngineOptions(dtype=torch.float32, device="cpu", bucket_bytes=1 << 30),
                             every_rank_drives=False,
                             pack_bucket=lambda bucket: [(name, f"rank{rank}:{name}") for name, _ in bucket])
    engine.update_weights(model)
    result: dict = {"calls": list(recorder.calls) if recorder else None}
    if recorder:
        recorder.fail_update = fail_update
    try:
        engine.update_weights(model)
    except EngineError as exc:
        result["error"] = str(exc)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # neither rank tears gloo down while the other may still be using it (seen: SIGABRT under load)
    dist.destroy_process_group()
    exit_process(0)  # no interpreter teardown: gloo's threads outlive it and can abort (vlrft.parallel.process_exit)

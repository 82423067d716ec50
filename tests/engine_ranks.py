"""Worker for the tensor-parallel routing test: two real processes (gloo) sharing one stand-in engine.

Each rank encodes a different number of prompts; the group pools them, the stand-in backend
"generates" completions that name their prompt, and every rank must get back exactly its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from vlrft.rollout.base import SamplingParams
from vlrft.parallel.process_exit import exit_process
from vlrft.rollout.colocate import ColocatedEngine, EngineOptions, GroupComm, RankLayout
from vlrft.tokens import TokenSpec
from vlrft.rollout.outputs import EngineSample
from vlrft.rollout.requests import EngineInputError, PromptRequest

EOS = 2


class EchoBackend:
    """Stand-in backend: completion j of a prompt is [first prompt id, j, EOS]; records how many prompts it ran."""

    def __init__(self):
        self.ran: list[int] = []

    def run(self, requests, sampling):
        self.ran.append(len(requests))
        return [EngineSample([r.prompt_ids[0], j, EOS], [-1.0, -1.0, -1.0], "stop")
                for r in requests for j in range(sampling.n)]


class StandInTokenizer:
    """Decodes ids to their str (the routing test does not need a vocabulary)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(row) for row in ids]


def worker(rank: int, out_dir: str, every_rank_drives: bool, failing_rank: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    layout = RankLayout(rank, 2, 2)
    backend = EchoBackend() if every_rank_drives or layout.is_leader else None

    def build(batch):
        if rank == failing_rank:
            raise EngineInputError(f"rank {rank}: sample refused")
        return [PromptRequest({}, [100 * rank + i], f"r{rank}p{i}") for i in range(rank + 1)]

    tokens = TokenSpec(pad_id=0, eos_ids=(EOS,), image_token_id=6, video_token_id=7)
    engine = ColocatedEngine(backend, build, layout, GroupComm(layout), lambda: None, StandInTokenizer(), tokens,
                             EngineOptions(dtype=None, device="cpu"), every_rank_drives=every_rank_drives)
    result: dict = {}
    try:
        rollouts = engine.generate(None, SamplingParams(n=2, max_new_tokens=8))
        result["completions"] = rollouts.completion_ids
        result["texts"] = rollouts.texts
    except EngineInputError as exc:
        result["error"] = str(exc)
    result["ran"] = backend.ran if backend is not None else None
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    exit_process(0)  # no interpreter teardown: gloo's threads outlive it and can abort (vlrft.parallel.process_exit)

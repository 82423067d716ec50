"""Distributed strategies: how the trainer wraps the policy, reduces numbers and steps the optimizer.

One code path for one process and many: the trainer only talks to a `Strategy`. `SingleProcess`
is the identity; `DDPStrategy` runs under `torchrun` (gloo on CPU, NCCL on GPUs). Every collective
here is called by every rank in the same order (docs/design.md, spine rule 6).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info_from_env() -> RankInfo:
    """Rank, world size and local rank as `torchrun` sets them (a single process otherwise)."""
    return RankInfo(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                    int(os.environ.get("LOCAL_RANK", 0)))


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Strategy:
    """Single process: no wrapping, reductions are identities."""

    def __init__(self, info: RankInfo | None = None):
        self.info = info or RankInfo()
        self.device = pick_device(self.info.local_rank)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module):
        """Context for micro-batches before the last one of an accumulation (skips DDP's gradient all-reduce)."""
        return contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduced copy of `tensor` over ranks ("sum" or "max")."""
        return tensor.clone()

    def all_gather_object(self, obj) -> list:
        return [obj]

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class DDPStrategy(Strategy):
    """`torch.nn.parallel.DistributedDataParallel` under torchrun; gloo on CPU, NCCL on CUDA."""

    def __init__(self, info: RankInfo | None = None):
        super().__init__(info or rank_info_from_env())
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend)
        # Object collectives (small, rare) go through a gloo group so they work with NCCL too.
        self._cpu_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # A micro-batch without images leaves the vision tower unused on that rank: let DDP find such
        # parameters instead of waiting forever for their gradients.
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if hasattr(model, "module") else model

    def no_sync(self, model: nn.Module):
        return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.detach().clone().to(self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return out.to(tensor.device)

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._cpu_group)
        return out

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._cpu_group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self._cpu_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def make_strategy(name: str) -> Strategy:
    """The strategy named by `train.strategy` ("single" or "ddp")."""
    if name != "single" and not all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        from vlrft.errors import UserError

        raise UserError(f"train.strategy={name} runs one process per device started by torchrun; launch with "
                        "`torchrun --nproc_per_node <devices> -m vlrft train CONFIG ...`, or use "
                        "train.strategy=single for one process")
    return DDPStrategy(rank_info_from_env()) if name == "ddp" else Strategy(rank_info_from_env())

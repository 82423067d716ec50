"""Distributed strategies: how the trainer loads, wraps, steps, syncs and checkpoints its models.

One code path for one process and many: the trainer only talks to a `Strategy`. `Strategy` is
the single process; `DDPStrategy` replicates the model under `torchrun` (gloo on CPU, NCCL on
GPUs); `vlrft.parallel.fsdp2.FSDP2Strategy` shards it. The trainer never assumes a plain replicated
module: it loads through `load_model`, wraps through `prepare_trainable`/`prepare_frozen`, steps
through `clip_and_step`, gathers weights for generation through `generation`, and checkpoints
through `save_checkpoint`/`load_checkpoint`.

Every collective here is called by every rank in the same order (docs/design.md, spine rule 6): a
method that gathers or reduces must be called by all ranks, including the NaN/inf skip decision,
which is all-reduced before anyone steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vlrft.errors import UserError
from vlrft.safe_load import load_torch

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


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


@dataclass
class TrainedModel:
    """A model being trained: what forward/backward run on, its optimizer and (optional) LR scheduler."""

    module: nn.Module  # as returned by `prepare_trainable` (DDP wrapper, FSDP2 module, ...)
    optimizer: torch.optim.Optimizer
    scheduler: Any | None = None


@dataclass(frozen=True)
class StepResult:
    """The outcome of one optimizer step over all ranks."""

    grad_norms: tuple[float, ...]  # global gradient norm of each part, before clipping
    skipped: bool  # a non-finite loss or gradient on some rank: nobody stepped, gradients dropped


@dataclass(frozen=True)
class ModelSource:
    """What `Strategy.load_model` loads: a model folder (or Hub id) and how."""

    path: str | Path
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    # Modules are added after loading (LoRA adapters): FSDP2 then keeps rank 0's model real (its adapters are
    # made there) until it is sharded. ZeRO-3 does not read it: its base is partitioned at load, the adapters at
    # deepspeed.initialize (rank 0's broadcast).
    adapters: bool = False


class Strategy:
    """Single process: no wrapping, reductions are identities, checkpoints are plain files."""

    name = "single"
    # Checkpoints written by this strategy can be resumed with another number of processes.
    reshards_checkpoints = False
    # The strategy's own checkpoint files hold the weights (FSDP2's `sharded/`, DeepSpeed's): a resume starts from
    # model.path and restores them, and `model/` is only an export. Here `model/` is the policy's weights.
    checkpoint_holds_weights = False

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

    # ------------------------------------------------------------------ models

    def load_model(self, source: ModelSource, *, trainable: bool) -> nn.Module:
        """The transformers model to train (`trainable`) or to keep frozen, loaded for this strategy.

        Sharding strategies override this to read the weights on rank 0 only.
        """
        from vlrft.models.loading import load_policy

        return load_policy(source.path, dtype=source.dtype, attn_implementation=source.attn_implementation,
                           trust_remote_code=source.trust_remote_code, device=self.device)

    def prepare_trainable(self, model: nn.Module, make_optimizer: MakeOptimizer
                          ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """(module to run forward/backward on, its optimizer) for a model being trained."""
        self.stage_backwards(model)
        return model, make_optimizer([p for p in model.parameters() if p.requires_grad])

    # Whether a parameter's gradient accumulator may fire more than once per backward (once per backbone call of
    # the shared-prompt forward: `vlrft.models.staged_backward`), so no call's gradients wait for another's. DDP's
    # reducer and DeepSpeed's gradient hooks take one gradient per parameter and backward: off there.
    stages_backward = True

    def stage_backwards(self, model: nn.Module) -> None:
        """Make the ActorVLs inside `model` run their shared forward's backward one call at a time."""
        for module in model.modules():
            if hasattr(module, "backward_in_stages"):
                module.backward_in_stages = self.stages_backward

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """A model used for inference only (the reference policy)."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module `prepare_trainable` was given (its parameters may be shards)."""
        return model

    # Kept for callers written against the first interface.
    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    @contextlib.contextmanager
    def generation(self, model: nn.Module) -> Iterator[None]:
        """Context in which `model`'s parameters are whole on this rank, so it can generate locally."""
        yield

    # Sharding strategies gather a block's weights from all ranks when it runs (a collective), so every rank must
    # run the vision tower equally often: ranks agree per forward, and one without images runs it on a dummy.
    balances_vision_calls = False

    def balance_vision_calls(self, models: Sequence[nn.Module | None]) -> None:
        """Make the ActorVLs inside `models` (policy, reference, critic) agree on vision calls across ranks.

        Only for strategies with `balances_vision_calls`; see `vlrft.models.vision_balance`.
        """
        if not self.balances_vision_calls:
            return
        for model in models:
            for module in model.modules() if model is not None else ():
                if hasattr(module, "agree_on_visual_kinds"):
                    module.agree_on_visual_kinds = self.agree_on_visual_kinds

    def agree_on_visual_kinds(self, kinds):
        """The visual kinds (images, videos) some rank encodes in this forward (every rank calls this)."""
        return kinds

    # ------------------------------------------------------------------ memory during rollout

    # Whether `offloaded_for_rollout` moves the trainer's state to host memory (train.fsdp.offload_during_rollout).
    offload_during_rollout = False

    def offload_to_cpu(self, parts: Sequence[TrainedModel], frozen: Sequence[nn.Module | None]) -> None:
        """Move the trained parts' parameters, gradients and optimizer state, and the frozen models, to host memory."""

    def reload_to_device(self, parts: Sequence[TrainedModel], frozen: Sequence[nn.Module | None]) -> None:
        """Undo `offload_to_cpu`: everything back on the device it was on."""

    @contextlib.contextmanager
    def offloaded_for_rollout(self, parts: Sequence[TrainedModel], frozen: Sequence[nn.Module | None]
                              ) -> Iterator[None]:
        """Context around the engine's wake/generate/sleep: the trainer's state in host memory when enabled."""
        if not self.offload_during_rollout:
            yield
            return
        self.offload_to_cpu(parts, frozen)
        try:
            yield
        finally:
            self.reload_to_device(parts, frozen)

    # ------------------------------------------------------------------ gradients

    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        loss.backward()

    def no_sync(self, module: nn.Module):
        """Context for micro-batches before the last one of an accumulation (skips the gradient reduction)."""
        return contextlib.nullcontext()

    def clip_and_step(self, parts: Sequence[TrainedModel], max_norm: float, nonfinite_local: bool) -> StepResult:
        """Clip each part's gradients to `max_norm` (0 = no clipping), then step all or none of them.

        The skip decision is all-reduced, so every rank steps or skips together; gradients are
        zeroed either way.
        """
        norms = [self.clip_grad_norm(part.module, max_norm) for part in parts]
        bad = torch.tensor([float(nonfinite_local or not all(math.isfinite(n) for n in norms))])
        skip = self.all_reduce(bad, "max").item() > 0
        if not skip:
            for part in parts:
                part.optimizer.step()
                if part.scheduler is not None:
                    part.scheduler.step()
        for part in parts:
            part.optimizer.zero_grad(set_to_none=True)
        return StepResult(tuple(norms), skip)

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> float:
        """Global gradient norm of `module`'s trainable parameters (over all shards), clipped in place."""
        params = [p for p in module.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        if hasattr(norm, "full_tensor"):  # DTensor gradients give a DTensor norm
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------ weight sync

    @contextlib.contextmanager
    def gathered(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """Context in which `params` can be read whole (ZeRO-3 gathers here; DTensors use `full_tensor()`)."""
        yield

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, folder: Path, parts: dict[str, TrainedModel], hf_model: nn.Module, processor,
                        export_hf: bool = True, hf_dtype: torch.dtype | None = None) -> None:
        """Write the trained models' weights and optimizer states into `folder` (every rank calls this).

        `folder/model/` holds the policy in Hugging Face format (from_pretrained works on it): here always, and in
        the weights' own dtype, since it is the policy's weights; strategies whose own files hold them write it only
        when `export_hf`, in `hf_dtype` (None: the weights' own).
        Here: `optimizer.pt`, and `<name>.pt` (model + optimizer) for every other part, e.g. the critic.
        """
        if not self.is_main:
            return
        hf_model.save_pretrained(folder / "model", safe_serialization=True)
        processor.save_pretrained(folder / "model")
        torch.save(parts["policy"].optimizer.state_dict(), folder / "optimizer.pt")
        for name, part in parts.items():
            if name != "policy":
                torch.save({"model": self.unwrap(part.module).state_dict(), "optimizer": part.optimizer.state_dict()},
                           folder / f"{name}.pt")

    def check_resumable(self, folder: Path, saved_world_size: int) -> None:
        """Raise `UserError` when this strategy cannot resume checkpoint `folder` (written by `saved_world_size`
        processes); called before any model loads (minutes for a large one)."""
        if not (folder / "optimizer.pt").is_file():
            raise UserError(f"checkpoint '{folder}' has no optimizer.pt: it was not written with train.strategy="
                            f"{self.name}; resume it with the strategy that wrote it (fsdp2 or deepspeed)")
        if saved_world_size != self.world_size and not self.reshards_checkpoints:
            raise UserError(f"checkpoint '{folder}' was written by {saved_world_size} processes; resume it "
                            f"with the same number (this run has {self.world_size}), or train with "
                            "train.strategy=fsdp2, whose checkpoints reshard to any number of processes")

    def load_checkpoint(self, folder: Path, parts: dict[str, TrainedModel]) -> None:
        """Restore what `save_checkpoint` wrote (the policy's weights were loaded from `folder/model`)."""
        # Rank 0 saved them from its GPU: read into host memory (optimizers move their state to the parameters'
        # devices), not onto GPU 0 from every rank.
        parts["policy"].optimizer.load_state_dict(load_torch(folder / "optimizer.pt", what="checkpoint optimizer "
                                                                                            "state"))
        for name, part in parts.items():
            if name != "policy":
                saved = load_torch(folder / f"{name}.pt", what=f"checkpoint {name} state")
                self.unwrap(part.module).load_state_dict(saved["model"])
                part.optimizer.load_state_dict(saved["optimizer"])

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduced copy of `tensor` over ranks ("sum" or "max")."""
        return tensor.clone()

    def all_gather_object(self, obj) -> list:
        return [obj]

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def barrier(self) -> None:
        pass

    def close(self, after_error: bool = False) -> None:
        """End the process group; `after_error`: this rank failed, so it must not wait for its peers."""


def collective_timeout(cfg: Any = None) -> timedelta:
    """`train.dist_timeout_minutes` of the run's config (30 min without one): every process group's timeout."""
    minutes = getattr(getattr(cfg, "train", None), "dist_timeout_minutes", 30.0)
    return timedelta(minutes=float(minutes))


def uses_nccl() -> bool:
    """Whether the default process group reduces CUDA tensors with NCCL ("nccl" or "cuda:nccl,cpu:gloo")."""
    return "nccl" in str(dist.get_backend())


class ProcessGroupStrategy(Strategy):
    """Base of the multi-process strategies: the process group and the collectives the trainer uses."""

    def __init__(self, info: RankInfo | None = None, cfg: Any = None):
        super().__init__(info or rank_info_from_env())
        timeout = collective_timeout(cfg)
        if not dist.is_initialized():
            # On GPUs NCCL for CUDA tensors and gloo for CPU ones: FSDP2's CPU offload keeps shards and gradients in
            # host memory, and gradient clipping, checkpoints and weight sync run collectives on them.
            dist.init_process_group(backend="cuda:nccl,cpu:gloo" if self.device.type == "cuda" else "gloo",
                                    timeout=timeout)
        # Object collectives (small, rare) go through a gloo group so they work with NCCL too.
        self._cpu_group = dist.new_group(backend="gloo", timeout=timeout) if dist.get_backend() != "gloo" else None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.detach().clone().to(self.device if uses_nccl() else "cpu")
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

    def agree_on_visual_kinds(self, kinds):
        """An all-reduce (max) of two flags over the CPU group: no device synchronisation in the forward."""
        from vlrft.models.vision_balance import VisualKinds

        flags = torch.tensor([float(flag) for flag in dataclasses.astuple(kinds)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._cpu_group)
        return VisualKinds(*(bool(flag > 0) for flag in flags))

    def close(self, after_error: bool = False) -> None:
        if dist.is_initialized():
            # After a clean run, meet first: a rank that tears gloo down while a peer still uses it aborts the
            # peer at exit ("terminate called without an active exception", seen in CI). A failed rank does not
            # wait: its peers may be stuck in another collective, and torchrun ends them when this one exits.
            if not after_error:
                self.barrier()
            dist.destroy_process_group()


class DDPStrategy(ProcessGroupStrategy):
    """`torch.nn.parallel.DistributedDataParallel`: every rank holds the whole model and optimizer."""

    name = "ddp"
    stages_backward = False  # the reducer marks each parameter ready once per backward

    def prepare_trainable(self, model: nn.Module, make_optimizer: MakeOptimizer
                          ) -> tuple[nn.Module, torch.optim.Optimizer]:
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        return self.wrap(model), optimizer

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # A micro-batch without images leaves the vision tower unused on that rank: let DDP find such
        # parameters instead of waiting forever for their gradients.
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if hasattr(model, "module") else model

    def no_sync(self, module: nn.Module):
        return module.no_sync() if hasattr(module, "no_sync") else contextlib.nullcontext()


STRATEGIES = ("single", "ddp", "fsdp2", "deepspeed")

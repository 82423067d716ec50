"""DeepSpeed ZeRO-2 / ZeRO-3 (`train.strategy=deepspeed`, options under `train.deepspeed`).

ZeRO-2 shards gradients and optimizer state over the ranks and keeps a whole copy of the weights
on each; ZeRO-3 shards the weights too: a layer's weights are gathered for its forward/backward
and freed after. Both run on GPUs (NCCL) and on CPU (`DS_ACCELERATOR=cpu`, gloo), which is how
the tests check them against the single-process run.

How the trainer's contract maps onto DeepSpeed:
- Gradient accumulation is the trainer's: `managed_gradient_accumulation: false` makes every
  `engine.step()` the accumulation boundary, and `engine.backward(loss, scale_wrt_gas=False)`
  leaves the loss as the trainer built it (its denominators already cover the whole mini-batch),
  so a mini-batch of any number of micro-batches is exact.
- Clipping is DeepSpeed's `gradient_clipping` (the global norm over all shards).
- The NaN/inf skip: DeepSpeed's own overflow path drops the gradients without touching weights
  or optimizer state when the global gradient norm is not finite (decided from the all-reduced
  norm, so on every rank). A non-finite *loss* on any rank is all-reduced first and then forces
  that same path on every engine, so the policy and critic step or skip together.
- ZeRO-3 loading: `from_pretrained` under transformers' `HfDeepSpeedConfig` builds the model
  inside `deepspeed.zero.Init`, so each rank holds only its shard (no full copy per rank).
- The reference model is an inference-only ZeRO-3 engine (no optimizer, sharded weights).
- Weight sync and HF-engine generation gather weights with `deepspeed.zero.GatheredParameters`
  on every rank in lock-step.
- Checkpoints: `engine.save_checkpoint` (sharded optimizer and fp32 master weights per rank) plus
  the policy gathered into `model/` in Hugging Face format. Resuming with another number of
  processes converts the checkpoint to DeepSpeed's universal format first.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vlrft.parallel.hf_export import save_gathered
from vlrft.parallel.strategy import (MakeOptimizer, ModelSource, ProcessGroupStrategy, RankInfo, StepResult,
                                 TrainedModel, collective_timeout)
from vlrft.errors import UserError
from vlrft.models import precision

CHECKPOINT_DIR = "deepspeed"  # inside a vlrft checkpoint folder: one DeepSpeed checkpoint per trained part
TAG = "state"  # the DeepSpeed checkpoint tag (one per vlrft checkpoint folder)


def import_deepspeed():
    """The `deepspeed` module, or a clear error naming the extra that installs it."""
    try:
        import deepspeed
    except ImportError as exc:
        raise UserError(f"train.strategy=deepspeed needs the deepspeed package ({exc}); install it with "
                        "`pip install 'vlrft[deepspeed]'`, or use train.strategy=fsdp2") from None
    return deepspeed


class DeepSpeedStrategy(ProcessGroupStrategy):
    """Policy and critic as DeepSpeed ZeRO engines; the reference as an inference ZeRO-3 engine (stage 3)."""

    name = "deepspeed"
    stages_backward = False  # ZeRO's gradient hooks reduce each parameter once per backward
    reshards_checkpoints = True
    checkpoint_holds_weights = True  # deepspeed/<part>/ (module states and optimizer partitions)
    balances_vision_calls = True  # ZeRO-3 gathers vision blocks per call; ZeRO-2 buckets gradients in call order

    def __init__(self, info: RankInfo | None = None, cfg: Any = None):
        self.ds = import_deepspeed()
        super().__init__(info, cfg)
        self.ds.init_distributed(dist_backend=dist.get_backend(), timeout=collective_timeout(cfg))  # adopts our group
        options = getattr(getattr(cfg, "train", None), "deepspeed", None)
        self.stage = int(getattr(options, "zero_stage", 3))
        self.offload_optimizer = bool(getattr(options, "offload_optimizer", False))
        self.offload_param = bool(getattr(options, "offload_param", False))
        self.max_grad_norm = float(getattr(getattr(cfg, "train", None), "max_grad_norm", 1.0))
        self.micro_batch_size = int(getattr(getattr(cfg, "train", None), "micro_batch_completions_per_rank", 1))
        model_dtype = getattr(getattr(cfg, "model", None), "dtype", "float32")
        self.compute_dtype = precision.compute_dtype(self.device, model_dtype)
        self._engines: dict[int, Any] = {}  # id(module given to prepare_*) -> its engine

    # ------------------------------------------------------------------ configuration

    def ds_config(self, *, trainable: bool) -> dict:
        """The DeepSpeed config of a trained (`trainable`) or an inference-only engine (the reference).

        Trained engines keep float32 weights and run their forward under the trainer's autocast
        (`compute_dtype`): DeepSpeed switches an outer CUDA autocast off inside its forward unless its
        `torch_autocast` section is on, so it is, with no module's gradients reduced in low precision
        (`lower_precision_safe_modules: []`, float32 reductions as FSDP2's). The reference is kept in
        `compute_dtype` (its bf16/fp16 section; `zero.Init` would cast it to float32 otherwise).
        """
        low = self.compute_dtype != torch.float32
        zero: dict[str, Any] = {"stage": self.stage if trainable else 3}
        if trainable and self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.device.type == "cuda"}
        if zero["stage"] == 3 and self.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.device.type == "cuda"}
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": 1,
            # Every engine.step() is the end of an accumulation of any number of backward calls.
            "managed_gradient_accumulation": False,
            "gradient_clipping": self.max_grad_norm if self.max_grad_norm > 0 else 0.0,
            "zero_optimization": zero,
            "bf16": {"enabled": not trainable and self.compute_dtype == torch.bfloat16},
            "fp16": {"enabled": not trainable and self.compute_dtype == torch.float16},
            **({"torch_autocast": {"enabled": True, "dtype": precision.dtype_name(self.compute_dtype),
                                   "lower_precision_safe_modules": []}} if trainable and low else {}),
            # The trainer's AdamW also runs on offloaded (CPU) shards.
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }

    @property
    def sharded_weights(self) -> bool:
        return self.stage == 3

    # ------------------------------------------------------------------ models

    def load_model(self, source: ModelSource, *, trainable: bool) -> nn.Module:
        """ZeRO-3 (and every reference model): built inside `zero.Init`, so each rank keeps only its shard.

        A model that gets LoRA adapters after loading is partitioned too: PEFT wraps the partitioned layers (reading
        only their in/out features) and `deepspeed.initialize` partitions the new adapter parameters.
        """
        if trainable and not self.sharded_weights:
            return super().load_model(source, trainable=trainable)
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        from vlrft.models.loading import DTYPES, _check_architecture
        from transformers import AutoModelForImageTextToText

        _check_architecture(source.path)
        if source.dtype not in DTYPES:
            raise UserError(f"model.dtype={source.dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        # transformers switches to zero.Init while this object is alive (it keeps a weak reference).
        hf_ds_config = HfDeepSpeedConfig(self.ds_config(trainable=trainable))
        try:
            model = AutoModelForImageTextToText.from_pretrained(
                str(source.path), dtype=DTYPES[source.dtype], attn_implementation=source.attn_implementation,
                trust_remote_code=source.trust_remote_code)
        finally:
            unset_hf_deepspeed_config()  # later from_pretrained calls (rollout engines) load whole models
            del hf_ds_config
        self._keep_used_conversions(model)
        for module in model.modules():  # zero.Init places the parameter shards; buffers (rotary tables) follow
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.device)
        return model

    def _keep_used_conversions(self, model: nn.Module) -> None:
        """Keep only the weight renamings the load used, as a plain `from_pretrained` does.

        transformers' ZeRO-3 load path records every candidate renaming of the architecture; saving
        (and the weight sync's checkpoint names) would then revert renamings that never happened and
        write e.g. `model.model.embed_tokens.weight`. Only rank 0 reads the checkpoint, so it decides.
        """
        conversions = getattr(model, "_weight_conversions", None) or []
        used = [i for i, c in enumerate(conversions) if getattr(c, "was_used", lambda: True)()]
        used = self.broadcast_object(used)  # every rank calls this, whatever it recorded
        if conversions:
            model._weight_conversions = [conversions[i] for i in used if i < len(conversions)]

    def _register_head(self, model: nn.Module) -> None:
        """ZeRO-3 gathers a layer's weights when that layer runs; the LM head's weight is read directly
        (the chunked logprobs call `F.linear` on it), so it is gathered with the outer module instead."""
        from vlrft.models.actor import split_head

        inner = getattr(model, "model", None)
        if inner is None or not hasattr(model, "logprobs"):  # a critic never runs the LM head
            return
        _, head = split_head(inner)
        for param in head.parameters(recurse=False):
            self.ds.zero.register_external_parameter(model, param)

    def prepare_trainable(self, model: nn.Module, make_optimizer: MakeOptimizer
                          ) -> tuple[nn.Module, torch.optim.Optimizer]:
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        if self.stage == 3:
            self._register_head(model)
        engine, _, _, _ = self.ds.initialize(model=model, optimizer=optimizer, config=self.ds_config(trainable=True))
        self._engines[id(model)] = engine
        # The client optimizer: DeepSpeed steps it on the flat shards and reads its param_groups' lr,
        # so an LR scheduler built on it drives the learning rate.
        return engine, optimizer

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """An inference-only ZeRO-3 engine: sharded weights, gathered layer by layer in forward."""
        self._register_head(model)  # the reference is ZeRO-3 whatever the policy's stage
        engine, _, _, _ = self.ds.initialize(model=model, config=self.ds_config(trainable=False))
        engine.eval()
        self._engines[id(model)] = engine
        return engine

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if hasattr(model, "module") and hasattr(model, "global_steps") else model

    def _engine_of(self, model: nn.Module):
        if hasattr(model, "global_steps"):
            return model
        return self._engines.get(id(model))

    @contextlib.contextmanager
    def generation(self, model: nn.Module) -> Iterator[None]:
        """ZeRO-3: every parameter gathered (all ranks together), layer hooks off so ranks decode independently."""
        engine = self._engine_of(model)
        if engine is None or not _is_zero3(engine):
            yield
            return
        offload = _parameter_offload(engine)
        with self.ds.zero.GatheredParameters(list(self.unwrap(engine).parameters()), modifier_rank=None):
            _remove_hooks(offload)
            try:
                yield
            finally:
                _add_hooks(offload)

    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        # scale_wrt_gas=False: the trainer's loss already averages over the whole mini-batch.
        self._engine_of(module).backward(loss, scale_wrt_gas=False)

    def no_sync(self, module: nn.Module):
        # ZeRO-2/3 reduce-scatter gradients into shards as they are produced; there is nothing to defer.
        return contextlib.nullcontext()

    def clip_and_step(self, parts: Sequence[TrainedModel], max_norm: float, nonfinite_local: bool) -> StepResult:
        """Every engine steps (clipping to `gradient_clipping` over all shards) or all skip.

        A non-finite loss on any rank forces DeepSpeed's overflow path on every engine. A non-finite
        gradient norm (the norm is global, so the same on every rank) makes that engine take the
        path by itself, and the engines after it are then forced to skip too; only an engine that
        already stepped before it (the policy, when just the critic's gradients are non-finite while
        every loss was finite) is not undone.
        """
        if abs((max_norm if max_norm > 0 else 0.0) - (self.max_grad_norm if self.max_grad_norm > 0 else 0.0)) > 1e-12:
            raise ValueError(f"DeepSpeed clips to train.max_grad_norm={self.max_grad_norm} (set at initialize); "
                             f"clip_and_step was asked for {max_norm}")
        bad = torch.tensor([float(nonfinite_local)])
        force_skip = self.all_reduce(bad, "max").item() > 0
        norms: list[float] = []
        applied: list[bool] = []
        for part in parts:
            engine = self._engine_of(part.module)
            with _forced_overflow(engine.optimizer) if force_skip else contextlib.nullcontext():
                engine.step()
            applied.append(bool(engine.was_step_applied()))
            force_skip = force_skip or not applied[-1]
            norm = engine.get_global_grad_norm()
            norms.append(float(norm) if norm is not None else math.nan)
        skipped = not all(applied)
        if not skipped:
            for part in parts:
                if part.scheduler is not None:
                    part.scheduler.step()
        return StepResult(tuple(norms), skipped)

    # ------------------------------------------------------------------ weight sync

    def gathered(self, params: Sequence[torch.Tensor]):
        """ZeRO-3: gather `params` whole on every rank (all ranks call this together, same params)."""
        sharded = [p for p in params if hasattr(p, "ds_id")]
        if not sharded:
            return contextlib.nullcontext()
        return self.ds.zero.GatheredParameters(sharded, modifier_rank=None)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, folder: Path, parts: dict[str, TrainedModel], hf_model: nn.Module, processor,
                        export_hf: bool = True, hf_dtype: torch.dtype | None = None) -> None:
        """`deepspeed/<part>/` (DeepSpeed's sharded checkpoint, every rank writes its shard) and, when `export_hf`,
        `model/` (in `hf_dtype`)."""
        for name, part in parts.items():
            engine = self._engine_of(part.module)
            engine.save_checkpoint(str(folder / CHECKPOINT_DIR / name), tag=TAG, save_latest=False)
        if not export_hf:
            return
        # ZeRO-3 gathers one tensor at a time; under ZeRO-2 every rank holds the whole weights (nothing to gather)
        save_gathered(hf_model, processor, folder / "model", is_main=self.is_main, gather=self.gathered,
                      dtype=hf_dtype)

    def check_resumable(self, folder: Path, saved_world_size: int, parts: tuple[str, ...] = ("policy",)) -> None:
        for name in parts:
            path = folder / CHECKPOINT_DIR / name / TAG
            if not path.is_dir():
                raise UserError(f"no DeepSpeed checkpoint in '{path}'; resume a checkpoint written with "
                                "train.strategy=deepspeed, or start without train.resume")

    def load_checkpoint(self, folder: Path, parts: dict[str, TrainedModel]) -> None:
        """Restore weights and optimizer state; another number of processes goes through the universal format."""
        from vlrft.parallel.safe_checkpoint import check_deepspeed_files

        self.check_resumable(folder, self.world_size, tuple(parts))
        for name, part in parts.items():
            engine = self._engine_of(part.module)
            path = folder / CHECKPOINT_DIR / name
            tag = TAG
            check_deepspeed_files(path / TAG)  # DeepSpeed reads them unchecked: nothing but data may be in them
            if _saved_world_size(path / TAG) != self.world_size:
                tag = self._universal(path)
                check_deepspeed_files(path / tag)
                engine._config.load_universal_checkpoint = True
            try:
                engine.load_checkpoint(str(path), tag=tag, load_optimizer_states=True,
                                       load_lr_scheduler_states=False, load_module_strict=True)
            finally:
                engine._config.load_universal_checkpoint = False

    def _universal(self, path: Path) -> str:
        """Tag of DeepSpeed's universal checkpoint of `path/TAG` (converted once, by rank 0): any world size reads it.

        Written next to the original (into the checkpoint folder), under a temporary name renamed
        into place when complete, so an interrupted conversion is redone rather than half-read.
        """
        tag = f"{TAG}_universal"
        if self.is_main and not (path / tag).is_dir():
            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            partial = path / f".{tag}-partial"
            shutil.rmtree(partial, ignore_errors=True)
            # rank 0 converts alone while the others wait (train.dist_timeout_minutes): DeepSpeed's worker processes,
            # each holding one rank's optimizer file (13.8 GB for 72B on 64 ranks) or one parameter's slices; on the
            # CPUs this process may use (a job's share of the node), 4 at most for host memory's sake
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
            workers = max(2, min(4, cpus // 2))
            ds_to_universal(argparse.Namespace(
                input_folder=str(path / TAG), output_folder=str(partial), num_extract_workers=workers,
                num_merge_workers=workers, keep_temp_folder=False, strict=True,
                # a plain (non-Megatron) model records no universal-checkpoint info; ZeRO-1/2 needs the default
                inject_missing_state=True))
            partial.rename(path / tag)
        self.barrier()
        return tag


def _saved_world_size(tag_folder: Path) -> int:
    """How many ranks wrote a DeepSpeed checkpoint: one optimizer-state file each."""
    return len(list(tag_folder.glob("*optim_states.pt")))


def _is_zero3(engine) -> bool:
    return engine.zero_optimization_stage() == 3


def _parameter_offload(engine):
    """The object holding ZeRO-3's per-layer gather/release hooks (trained and inference engines)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)


def _remove_hooks(offload) -> None:
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks.clear()
    offload.backward_hooks.clear()


def _add_hooks(offload) -> None:
    offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def _forced_overflow(optimizer) -> Iterator[None]:
    """Make the next ZeRO `step()` see an invalid global gradient norm: DeepSpeed then drops the
    gradients and leaves weights and optimizer state untouched (its fp16-overflow path).

    Every rank enters this together (the decision was all-reduced), so skipping the norm's own
    all-reduce keeps the ranks' collectives in step.
    """
    invalid = torch.tensor(float("inf"))
    name = "scaled_global_norm" if hasattr(optimizer, "scaled_global_norm") else "_get_norm_groups"
    replacement = (lambda *a, **k: invalid) if name == "scaled_global_norm" else (lambda *a, **k: [invalid])
    setattr(optimizer, name, replacement)
    try:
        yield
    finally:
        delattr(optimizer, name)

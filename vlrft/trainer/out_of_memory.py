"""A device out of memory in a phase of a step: an error naming the phase, what it held, and the options that help.

`torch.OutOfMemoryError` (CUDA's "out of memory") raised inside `explain_out_of_memory` becomes an
`OutOfMemory` (a `UserError`: the CLI prints it as one line, `--debug` shows the original
traceback). Each phase lists only the options that reduce its own memory, with their current values,
computed from the run's config by `sampling_fixes` / `training_fixes`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from vlrft.config import Config
from vlrft.errors import UserError

# torch >= 2.5 names it torch.OutOfMemoryError (CUDA's and other devices'); 2.4 only torch.cuda.OutOfMemoryError.
DEVICE_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
RESUME = ("Nothing of this step was saved; after changing the config, resume from the last checkpoint with "
          "train.resume=auto. `vlrft plan CONFIG` estimates each phase's memory per device")


class OutOfMemory(UserError):
    """The device ran out of memory; the message names the phase, what it held and the options that help."""


@contextlib.contextmanager
def explain_out_of_memory(where: str, fixes: Sequence[str]) -> Iterator[None]:
    """Re-raise a device out-of-memory error inside the block as `OutOfMemory`: `where` it happened, `fixes`."""
    try:
        yield
    except DEVICE_OUT_OF_MEMORY as exc:
        lines = str(exc).strip().splitlines()
        cause = lines[0].rstrip(".") if lines else "out of memory"
        raise OutOfMemory(f"{where}: the device ran out of memory ({cause}). To fit it: {'; '.join(fixes)}. "
                          f"{RESUME}") from exc


def sampling_fixes(cfg: Config, world_size: int, batch_fix: str | None = None) -> list[str]:
    """What lowers the memory of sampling completions with `cfg.rollout.engine`; `batch_fix`: the option that
    sets how many are sampled at once, where that is not rollout.global_batch_completions (evaluation)."""
    r = cfg.rollout
    per_rank = max(1, r.global_batch_completions // max(1, world_size))
    if r.engine == "hf":
        fixes = [batch_fix or f"lower rollout.global_batch_completions (now {r.global_batch_completions}: the hf "
                 f"engine samples this rank's {per_rank} completions at once, their KV caches side by side)",
                 f"or rollout.max_trajectory_tokens (now {r.max_trajectory_tokens})" if r.tools else
                 f"or rollout.max_new_tokens (now {r.max_new_tokens})"]
        if cfg.train.strategy in ("fsdp2", "deepspeed"):
            fixes.append(f"the hf engine gathers the whole policy on every rank under train.strategy="
                         f"{cfg.train.strategy}; for a model that does not fit one device whole, use "
                         "rollout.engine=vllm with rollout.tensor_parallel_size")
        else:
            fixes.append("or use rollout.engine=vllm (a paged KV cache)")
        return fixes
    fixes = [f"lower rollout.gpu_memory_utilization (now {r.gpu_memory_utilization}): the engine's share of the GPU; "
             "the trainer's state needs the rest"]
    if not r.sleep_between_steps:
        fixes.append("set rollout.sleep_between_steps=true (the engine frees its memory while the trainer trains)")
    return [batch_fix, *fixes] if batch_fix else fixes


def training_fixes(cfg: Config) -> list[str]:
    """What lowers the memory of the trainer's forward/backward passes and its optimizer step."""
    t = cfg.train
    fixes = [f"lower train.micro_batch_completions_per_rank (now {t.micro_batch_completions_per_rank})"
             if t.max_tokens_per_micro_batch <= 0 else
             f"lower train.max_tokens_per_micro_batch (now {t.max_tokens_per_micro_batch})"]
    if t.max_tokens_per_micro_batch <= 0:
        fixes.append("or set train.max_tokens_per_micro_batch (micro-batches by a token budget)")
    if not cfg.model.gradient_checkpointing:
        fixes.append("set model.gradient_checkpointing=true (activations recomputed in backward)")
    if t.strategy == "ddp":
        fixes.append("shard the weights, gradients and optimizer state over the ranks: train.strategy=fsdp2 "
                     "(now ddp)")
    elif t.strategy == "single":
        fixes.append("use more GPUs with train.strategy=fsdp2 under torchrun (sharded state)")
    elif t.strategy == "fsdp2" and not t.fsdp.cpu_offload:
        fixes.append("keep shards and optimizer state in host memory: train.fsdp.cpu_offload=true")
    elif t.strategy == "deepspeed" and t.deepspeed.zero_stage == 2:
        fixes.append("shard the weights too: train.deepspeed.zero_stage=3")
    elif t.strategy == "deepspeed" and not t.deepspeed.offload_optimizer:
        fixes.append("keep the optimizer state in host memory: train.deepspeed.offload_optimizer=true")
    if cfg.model.lora.rank <= 0:
        fixes.append("or train LoRA adapters (model.lora.rank > 0): no optimizer state for the frozen weights")
    return fixes

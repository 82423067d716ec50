"""The dtype a run computes in: `model.dtype` on GPUs, float32 on CPU.

On GPUs the policy's weights, gradients and optimizer state stay float32 while its forward (and the
hf engine's sampling) runs under autocast in `model.dtype`, FSDP2 gathers the weights in it and the
reference model is loaded in it. On CPU everything is float32, unless `VLRFT_CPU_MIXED_PRECISION=1`:
then a CPU run takes the GPUs' mixed-precision paths (CPU autocast, FSDP2's bf16 gathers over gloo,
a bf16 reference), which is how the tests exercise those paths without a GPU. It is slower on most
CPUs and its numbers are not the float32 ones.
"""

from __future__ import annotations

import contextlib
import os

import torch

CPU_MIXED_PRECISION_ENV = "VLRFT_CPU_MIXED_PRECISION"


def dtype_name(dtype: torch.dtype) -> str:
    """The name `model.dtype` and DeepSpeed's config use for a torch dtype: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def active_autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype an autocast active here runs `device`'s matmuls in, or None when none is active for it."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def compute_dtype(device: torch.device, model_dtype: str) -> torch.dtype:
    """The dtype matmuls run in on `device` for `model.dtype` (a name such as "bfloat16")."""
    if device.type == "cuda" or (device.type == "cpu" and os.environ.get(CPU_MIXED_PRECISION_ENV) == "1"):
        return getattr(torch, model_dtype)
    return torch.float32


def autocast(device: torch.device, model_dtype: str, cache_casts: bool = True) -> contextlib.AbstractContextManager:
    """The forward's mixed precision: autocast in `compute_dtype`, or nothing where that is float32.

    `cache_casts`: autocast keeps the low-precision copy of every float32 weight it casts until the
    region ends (torch's cast cache), so a forward over the whole model holds 2 bytes per parameter
    of copies at its end. Worth it where those copies are kept anyway (saved for the backward) and
    reused (generation casts once for all its steps); not under gradient checkpointing, where the
    backward recomputes each layer and casts again (`forward_autocast`).
    """
    dtype = compute_dtype(device, model_dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache_casts)


def forward_autocast(device: torch.device, model_dtype: str, gradient_checkpointing: bool
                     ) -> contextlib.AbstractContextManager:
    """The mixed precision of the trainer's scoring and training forwards (not generation's).

    Under gradient checkpointing no weight cast is cached: each layer's copy is freed with the layer,
    instead of every layer's copy held to the end of the forward (2 bytes per parameter: 7 GiB for
    a 3.75 B model; under ZeRO-3 or FSDP2 without its own mixed precision, the whole model's gathered
    weights on every GPU). Without checkpointing autograd keeps each copy for the backward anyway,
    and the cache lets the shared-prompt forward's two passes keep one copy instead of two.
    """
    return autocast(device, model_dtype, cache_casts=not gradient_checkpointing)

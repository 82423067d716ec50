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


def autocast(device: torch.device, model_dtype: str) -> contextlib.AbstractContextManager:
    """The forward's mixed precision: autocast in `compute_dtype`, or nothing where that is float32."""
    dtype = compute_dtype(device, model_dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)

"""Trainer state in host memory while a colocated rollout engine (vLLM, SGLang) holds the GPU.

During rollout the trainer's parameter shards, gradients and optimizer state are idle, and the
engine's weights and KV cache need the memory. `to_host` copies each of those tensors into host
memory and drops the device copy; `to_device` copies them back where they were. Modules move with
`nn.Module._apply`, which keeps every `nn.Parameter` object (the optimizer's references stay valid;
FSDP2 re-points its shard bookkeeping in its `_apply` override). Optimizer state tensors go back
to the device each came from (AdamW's `step` counter stays on the CPU unless fused/capturable).
The copies are real copies even from CPU to CPU, so the round trip is exercised by CPU tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def move_module(module: nn.Module, device: torch.device | str) -> None:
    """Parameters (with their gradients) and buffers of `module` copied to `device`, same Python objects."""
    module._apply(lambda t: t.to(device, copy=True))


class OptimizerStateOffload:
    """Moves one optimizer's state tensors to host memory and back to the device each came from."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.devices: dict[tuple[int, str], torch.device] = {}

    def to_host(self) -> None:
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.devices[(id(param), key)] = value.device
                    state[key] = value.to("cpu", copy=True)

    def to_device(self) -> None:
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                device = self.devices.get((id(param), key))
                if isinstance(value, torch.Tensor) and device is not None:
                    state[key] = value.to(device, copy=True)
        self.devices.clear()


class RolloutOffload:
    """The trained modules, their optimizers and the frozen modules (reference) of one run, offloadable together."""

    def __init__(self, modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 frozen: Sequence[nn.Module], device: torch.device):
        self.modules = [*modules, *frozen]
        self.optimizers = [OptimizerStateOffload(o) for o in optimizers]
        self.device = device

    def to_host(self) -> None:
        for module in self.modules:
            move_module(module, "cpu")
        for optimizer in self.optimizers:
            optimizer.to_host()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back before the engine allocates

    def to_device(self) -> None:
        for module in self.modules:
            move_module(module, self.device)
        for optimizer in self.optimizers:
            optimizer.to_device()

"""Bytes of tensor storages made inside the mode and still alive (a CPU stand-in for the CUDA allocator's counters)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """`current`: bytes of the storages created by ops inside the mode that are still alive; `peak`: their maximum."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                self._track(tensor.untyped_storage())
        return out

    def ignore(self, *tensors: torch.Tensor) -> "LiveBytes":
        """Never count these tensors' storages (made before the mode; views of them and in-place ops on them return
        them again)."""
        for tensor in tensors:
            self._live.setdefault(tensor.untyped_storage().data_ptr(), 0)
        return self

    def _track(self, storage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._live or size == 0:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._gone, key)

    def _gone(self, key: int) -> None:
        size = self._live.pop(key, None)
        if size is not None:
            self.current -= size

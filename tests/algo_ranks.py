"""Run a function as several fake "ranks" in threads, with exact sum/max all-reduces between them.

Lets the algorithm tests check multi-rank exactness (reduce via sums and counts) in milliseconds,
without launching processes.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch


class _AllReduce:
    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=10)
        self.slots: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()  # everyone has written
            out = self.slots[0]
            for other in self.slots[1:]:
                out = op(out, other)
            self.barrier.wait()  # everyone has read before the next call overwrites
            return out.to(t.dtype)

        return reduce


def run_ranks(world: int, fn: Callable[[int, Callable, Callable], Any]) -> list[Any]:
    """Call fn(rank, sum_reduce, max_reduce) on `world` threads; returns the results in rank order."""
    sums, maxes = _AllReduce(world), _AllReduce(world)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(fn, r, sums.for_rank(r, torch.add), maxes.for_rank(r, torch.maximum))
                   for r in range(world)]
        return [f.result(timeout=30) for f in futures]

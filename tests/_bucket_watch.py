"""Counts the weight buckets' tensors still alive each time the next bucket is gathered (one bucket at a time)."""

from __future__ import annotations

import contextlib
import weakref

from vlrft.rollout.weights import PolicyWeights


class BucketWatch:
    """Records a weak reference to every tensor `PolicyWeights` hands out; `gather` (the strategy's gather
    context, a no-op here) notes how many of them are alive when a bucket's gather starts."""

    def __init__(self, monkeypatch):
        self.handed_out: list[weakref.ref] = []
        self.alive_at_each_gather: list[int] = []
        materialise = PolicyWeights._materialise

        def watched(weights, entry, device):
            tensor = materialise(weights, entry, device)
            self.handed_out.append(weakref.ref(tensor))
            return tensor

        monkeypatch.setattr(PolicyWeights, "_materialise", watched)

    def gather(self, params):
        self.alive_at_each_gather.append(sum(ref() is not None for ref in self.handed_out))
        return contextlib.nullcontext()

"""Counts the weight buckets' tensors still alive each time a tensor is gathered after its bucket was handed out
(one bucket at a time)."""

from __future__ import annotations

import contextlib
import weakref

from vlrft.models.weights import PolicyWeights


class BucketWatch:
    """Records a weak reference to every tensor `PolicyWeights` hands out, by bucket; `gather` (the strategy's
    gather context, a no-op here, called for each tensor) notes how many tensors of buckets already handed out
    are still alive."""

    def __init__(self, monkeypatch):
        self.building: list[weakref.ref] = []  # the tensors of the bucket being gathered
        self.handed_out: list[weakref.ref] = []  # those of the buckets already handed out
        self.alive_at_each_gather: list[int] = []
        materialise, buckets = PolicyWeights._materialise, PolicyWeights.buckets

        def watched(weights, entry, device):
            tensor = materialise(weights, entry, device)
            self.building.append(weakref.ref(tensor))
            return tensor

        def watched_buckets(weights, *args, **kwargs):
            produced = buckets(weights, *args, **kwargs)
            while True:  # not a `for` loop: its variable would keep the bucket while the caller asks for the next
                handed = [next(produced, None)]
                if handed[0] is None:
                    return
                self.handed_out += self.building
                self.building = []
                yield handed.pop()

        monkeypatch.setattr(PolicyWeights, "_materialise", watched)
        monkeypatch.setattr(PolicyWeights, "buckets", watched_buckets)

    def gather(self, params):
        self.alive_at_each_gather.append(sum(ref() is not None for ref in self.handed_out))
        return contextlib.nullcontext()

"""Metrics kept as sums, counts and maxima so that micro-batches and ranks combine exactly.

A mean of per-rank means is wrong whenever ranks hold different numbers of tokens; `Stats` keeps
the numerator and the denominator apart until the very end. Values stay detached tensors so that
recording a metric never forces a device synchronisation; `means()` reads them all back at once.

    stats = Stats()
    stats.add_masked("actor/entropy", entropy, mask)      # sum over valid tokens, count = valid tokens
    stats.add_max("actor/ratio_max", ratio, mask)
    total = stats.merge(other_micro_batch_stats)
    total = total.reduce(all_reduce_sum, all_reduce_max)  # every rank, same keys (it is a collective)
    log(total.means())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

Reducer = Callable[[Tensor], Tensor]


def _scalar(value: Tensor | float) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().to(torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64)


def _pack(values: list[Tensor], device: torch.device) -> Tensor:
    """One float64 vector on `device` (empty when there is nothing), ready for a single all-reduce."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([v.to(device) for v in values])


@dataclass
class Stats:
    """Named metrics: mean-type ones as (sum, count) pairs, max-type ones as running maxima."""

    sums: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)
    maxima: dict[str, Tensor] = field(default_factory=dict)

    def add(self, name: str, total: Tensor | float, count: Tensor | float = 1.0) -> "Stats":
        """Add `total` to the metric's sum and `count` to its count (a plain value is `add(name, v)`)."""
        total, count = _scalar(total), _scalar(count)
        if name in self.sums:
            self.sums[name] = self.sums[name] + total.to(self.sums[name].device)
            self.counts[name] = self.counts[name] + count.to(self.counts[name].device)
        else:
            self.sums[name], self.counts[name] = total, count.to(total.device)
        return self

    def add_masked(self, name: str, values: Tensor, mask: Tensor) -> "Stats":
        """Add the sum of `values` where `mask` is set, counting the set positions."""
        mask = mask.to(values.dtype)
        return self.add(name, (values.detach() * mask).sum(), mask.sum())

    def add_max(self, name: str, values: Tensor | float, mask: Tensor | None = None) -> "Stats":
        """Keep the largest value seen (only where `mask` is set); reduced with max, never summed."""
        values = values.detach() if isinstance(values, Tensor) else torch.tensor(float(values))
        values = values.to(torch.float64)
        if mask is not None:
            values = values.masked_fill(~mask.bool(), float("-inf"))
        value = values.max() if values.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
        if name in self.maxima:
            self.maxima[name] = torch.maximum(self.maxima[name], value.to(self.maxima[name].device))
        else:
            self.maxima[name] = value
        return self

    def merge(self, other: "Stats") -> "Stats":
        """A new `Stats` holding both sets of metrics (sums and counts added, maxima maxed)."""
        out = Stats(dict(self.sums), dict(self.counts), dict(self.maxima))
        for name, total in other.sums.items():
            out.add(name, total, other.counts[name])
        for name, value in other.maxima.items():
            out.add_max(name, value)
        return out

    def emptied(self) -> "Stats":
        """The same metric names with nothing recorded (sums and counts 0, no maximum): what a rank merges for a
        forward whose statistics must not count (a filler), so that its key set still agrees in `reduce`."""
        return Stats({n: torch.zeros_like(v) for n, v in self.sums.items()},
                     {n: torch.zeros_like(v) for n, v in self.counts.items()},
                     {n: torch.full_like(v, float("-inf")) for n, v in self.maxima.items()})

    def reduce(self, sum_fn: Reducer, max_fn: Reducer | None = None) -> "Stats":
        """Combine across ranks with one sum-all-reduce (and one max-all-reduce when `max_fn` is given).

        This is a collective: call it on every rank with stats produced by the same code path, so
        that the key sets (sorted here) agree. Without `max_fn`, maxima stay local.
        """
        names, max_names = sorted(self.sums), sorted(self.maxima)
        stored = [*self.sums.values(), *self.maxima.values()]
        device = stored[0].device if stored else torch.device("cpu")
        packed = _pack([self.sums[n] for n in names] + [self.counts[n] for n in names], device)
        packed = sum_fn(packed)
        out = Stats()
        for i, name in enumerate(names):
            out.sums[name], out.counts[name] = packed[i], packed[len(names) + i]
        if max_fn is None:
            out.maxima = dict(self.maxima)
            return out
        top = max_fn(_pack([self.maxima[n] for n in max_names], device))
        out.maxima = {name: top[i] for i, name in enumerate(max_names)}
        return out

    def means(self) -> dict[str, float]:
        """Plain floats for logging: sum / count for mean-type metrics, the maximum for max-type ones.

        A metric with nothing recorded (count 0, or no finite maximum) is left out rather than
        reported as NaN.
        """
        names, max_names = sorted(self.sums), sorted(self.maxima)
        values = [self.sums[n] for n in names] + [self.counts[n] for n in names] + [self.maxima[n] for n in max_names]
        if not values:
            return {}
        device = values[0].device
        flat = torch.stack([v.to(device) for v in values]).tolist()  # one device-to-host copy for everything
        sums, counts, maxima = flat[:len(names)], flat[len(names):2 * len(names)], flat[2 * len(names):]
        out = {n: s / c for n, s, c in zip(names, sums, counts) if c > 0}
        out.update({n: v for n, v in zip(max_names, maxima) if v != float("-inf")})
        return out

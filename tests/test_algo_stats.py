"""`Stats`: sums and counts that combine exactly over micro-batches and ranks; maxima reduced with max."""

from __future__ import annotations

import torch

from algo_ranks import run_ranks
from vlrft.algo import Stats


def test_merge_is_a_token_weighted_mean_not_a_mean_of_means():
    a = Stats().add("x", 3.0, 2.0)   # micro-batch 1: mean 1.5 over 2 tokens
    b = Stats().add("x", 5.0, 6.0)   # micro-batch 2: mean 0.833 over 6 tokens
    # (3 + 5) / (2 + 6) = 1.0, while the mean of means would be 1.1667
    assert a.merge(b).means() == {"x": 1.0}
    assert a.means() == {"x": 1.5}  # merge returns a new object


def test_masked_sum_and_max():
    s = Stats().add_masked("e", torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]))
    s.add_max("m", torch.tensor([1.0, 7.0, 3.0]), torch.tensor([1, 0, 1]))
    # e: (1 + 2) / 2 = 1.5 (9 is masked out); m: the 7 is masked out -> 3
    assert s.means() == {"e": 1.5, "m": 3.0}
    assert s.merge(Stats().add_max("m", 5.0)).means()["m"] == 5.0


def test_empty_metrics_are_left_out_instead_of_nan():
    s = Stats().add_masked("e", torch.tensor([1.0]), torch.tensor([0])).add_max("m", torch.tensor([]))
    assert s.means() == {}


def test_reduce_over_ranks_sums_counts_and_takes_the_max():
    def fn(rank, sum_reduce, max_reduce):
        values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])][rank]
        s = Stats().add_masked("x", values, torch.ones_like(values)).add_max("top", values)
        return s.reduce(sum_reduce, max_reduce).means()

    # x: (1 + 2 + 3) / 3 = 2.0 (mean of rank means would be 2.25); top: max(2, 3) = 3
    assert run_ranks(2, fn) == [{"x": 2.0, "top": 3.0}] * 2

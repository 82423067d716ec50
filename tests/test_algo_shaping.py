"""Reward shaping: overlong penalty, clipping, running normalisation, the dynamic-sampling filter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from algo_ranks import run_ranks
from vlrft.algo import (RunningMoments, clip_rewards, compute_advantages, expand_groups, overlong_penalty,
                        policy_loss, zero_variance_groups)
from vlrft.config import AlgorithmConfig

NAN = float("nan")


def test_overlong_penalty_ramps_inside_the_buffer():
    # max 20, buffer 4 -> ramp starts after 16: 10 -> 0, 16 -> 0, 18 -> (16 - 18) / 4 = -0.5, 20 -> -1, 21 -> -1
    out = overlong_penalty(torch.tensor([10, 16, 18, 20, 21]), max_new_tokens=20, buffer=4, penalty=1.0)
    assert out.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    # penalty factor 0.5 halves it; buffer 0 turns it off
    assert overlong_penalty(torch.tensor([18]), 20, 4, 0.5).tolist() == [-0.25]
    assert overlong_penalty(torch.tensor([25, 5]), 20, 0, 1.0).tolist() == [0.0, 0.0]


def test_clip_rewards_keeps_nan_and_does_not_modify_the_input():
    rewards = torch.tensor([-5.0, 0.5, 3.0, NAN])
    out = clip_rewards(rewards, 1.0)
    assert out[:3].tolist() == [-1.0, 0.5, 1.0] and out[3].isnan()
    assert rewards[0].item() == -5.0
    assert clip_rewards(rewards, None)[:3].tolist() == [-5.0, 0.5, 3.0]


def test_running_moments_accumulate_ignore_nan_and_checkpoint():
    rm = RunningMoments()
    rm.update(torch.tensor([1.0, NAN, 2.0, 3.0]))
    rm.update(torch.tensor([4.0, 5.0]))
    # all five values 1..5: mean 3, unbiased var = (4 + 1 + 0 + 1 + 4) / 4 = 2.5, std 1.581139
    assert (rm.count, rm.mean, rm.std) == (5, pytest.approx(3.0), pytest.approx(1.581139, abs=1e-6))
    # (6 - 3) / 1.581139 = 1.897367; NaN stays NaN
    out = rm.normalize(torch.tensor([3.0, 6.0, NAN]))
    assert out[:2].tolist() == pytest.approx([0.0, 1.897367], abs=1e-5) and out[2].isnan()
    resumed = RunningMoments()
    resumed.load_state_dict(rm.state_dict())
    assert (resumed.count, resumed.mean, resumed.std) == (5, 3.0, pytest.approx(1.581139, abs=1e-6))


def test_running_moments_do_not_scale_before_two_values():
    rm = RunningMoments()
    rm.update(torch.tensor([4.0]))
    assert rm.std == 1.0 and rm.normalize(torch.tensor([5.0])).tolist() == pytest.approx([1.0], abs=1e-5)


def test_running_moments_are_identical_on_every_rank():
    def fn(rank, sum_reduce, _max):
        rm = RunningMoments()
        rm.update(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]][rank]), reduce=sum_reduce)
        return rm.count, rm.mean, rm.std

    # the global batch is 1..5: count 5, mean 3, std 1.581139 on both ranks
    assert run_ranks(2, fn) == [(5, 3.0, pytest.approx(1.581139, abs=1e-6))] * 2


def test_zero_variance_groups_are_nan_aware():
    # G 2: [1, 1] equal; [0, 1] spread; [NaN, NaN] nothing; [2, NaN] a single valid reward; [3, 3] equal
    flags = zero_variance_groups(torch.tensor([1, 1, 0, 1, NAN, NAN, 2, NAN, 3, 3]), 2)
    assert flags.tolist() == [True, False, True, True, True]
    assert expand_groups(flags[:2], 2).tolist() == [True, True, False, False]


def test_all_zero_variance_batch_trains_on_nothing_without_nan():
    """Dynamic sampling's degenerate case: every group is uninformative; nothing may divide 0 / 0."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, NAN, NAN])
    assert zero_variance_groups(rewards, 2).all()
    cfg = AlgorithmConfig()
    mask = torch.ones(6, 3, dtype=torch.bool)
    for advantage in ("grpo", "rloo", "cpgd"):
        adv = compute_advantages(dataclasses.replace(cfg, advantage=advantage, cpgd_weight="clip_filter"),
                                 rewards, mask, 2)
        assert adv.advantages.abs().max().item() == 0.0
    logp = torch.zeros(6, 3, requires_grad=True)
    out = policy_loss(cfg, logp, torch.zeros(6, 3), adv.advantages, mask & adv.valid[:, None])
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.isfinite(logp.grad).all()

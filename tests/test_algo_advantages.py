"""Advantage estimators against values computed by hand (small tensors, arithmetic in the comments)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from algo_ranks import run_ranks
from vlrft.algo import ADVANTAGE_ESTIMATORS, EstimatorOutput, compute_advantages, register_advantage
from vlrft.algo.advantages import broadcast_to_tokens, sequence_scores
from vlrft.config import AlgorithmConfig
from vlrft.errors import UserError

NAN = float("nan")
ALL_ESTIMATORS = ["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "cpgd"]


def cfg(**kw) -> AlgorithmConfig:
    return dataclasses.replace(AlgorithmConfig(), **kw)


def ones(n: int, t: int = 1) -> torch.Tensor:
    return torch.ones(n, t, dtype=torch.bool)


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def first_token(result) -> list[float]:
    return result.advantages[:, 0].tolist()


def run(advantage: str, rewards, mask=None, group_size=2, **kw):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = ones(len(rewards)) if mask is None else torch.tensor(mask, dtype=torch.bool)
    values = kw.pop("values", None)
    token_rewards = kw.pop("token_rewards", None)
    return compute_advantages(cfg(advantage=advantage, **kw), rewards, mask, group_size,
                              values=None if values is None else torch.tensor(values),
                              token_rewards=None if token_rewards is None else torch.tensor(token_rewards))


# ------------------------------------------------------------------------------------------ GRPO family


def test_grpo_group_normalisation_with_padding():
    # group [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std 0.57735
    # A = +-0.5 / 0.57735 = +-0.866025; group [2, 2, 2, 2] has no spread -> 0
    mask = [[1, 1, 0]] + [[1, 1, 1]] * 7
    out = run("grpo", [1, 0, 0, 1, 2, 2, 2, 2], mask, group_size=4)
    assert first_token(out) == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0], abs=1e-5)
    assert out.advantages[0].tolist() == pytest.approx([0.866025, 0.866025, 0.0], abs=1e-5)  # padding stays 0
    assert out.returns is None


def test_grpo_not_applicable_reward_is_left_out_of_the_group_statistics():
    # valid rewards 3, 1, 2: mean 2, deviations 1, -1, 0, unbiased var = 2 / 2 = 1 -> A = 1, -1, 0; NaN row -> 0
    out = run("grpo", [3, NAN, 1, 2], group_size=4)
    assert first_token(out) == pytest.approx([1.0, 0.0, -1.0, 0.0], abs=1e-5)
    assert out.valid.tolist() == [True, False, True, True]


@pytest.mark.parametrize("advantage", ALL_ESTIMATORS)
@pytest.mark.parametrize("rewards, group_size", [
    ([5.0, -3.0], 1),            # G = 1
    ([0.7, 0.7, 0.7, 0.7], 2),   # all rewards equal
    ([NAN, NAN, 1.0, NAN], 2),   # an all-"not applicable" group, and a group with a single valid reward
])
def test_no_signal_gives_zero_group_advantages_and_never_nan(advantage, rewards, group_size):
    values = [[0.0]] * len(rewards)
    out = run(advantage, rewards, group_size=group_size, values=values, gae_whiten=False)
    assert torch.isfinite(out.advantages).all()
    if out.returns is not None:
        assert torch.isfinite(out.returns).all()
    if advantage in ("grpo", "drgrpo", "rloo", "cpgd", "reinforce_pp_baseline"):
        assert out.advantages.abs().max().item() == 0.0


def test_grpo_scale_batch_divides_by_the_std_of_all_rewards():
    # groups [0, 2] and [1, 1]: centred -1, 1, 0, 0; batch rewards 0, 2, 1, 1 have mean 1,
    # unbiased var = (1 + 1 + 0 + 0) / 3 = 2/3, std 0.816497 -> A = -1.224745, 1.224745, 0, 0
    out = run("grpo", [0, 2, 1, 1], scale_rewards="batch")
    assert first_token(out) == pytest.approx([-1.224745, 1.224745, 0, 0], abs=1e-5)


def test_grpo_scale_none_and_drgrpo_only_centre():
    # group [1, 0, 0, 1] centred: 0.5, -0.5, -0.5, 0.5 (no std division, whatever scale_rewards says for drgrpo)
    assert first_token(run("grpo", [1, 0, 0, 1], group_size=4, scale_rewards="none")) == [0.5, -0.5, -0.5, 0.5]
    assert first_token(run("drgrpo", [1, 0, 0, 1], group_size=4, scale_rewards="group")) == [0.5, -0.5, -0.5, 0.5]


def test_grpo_folds_token_rewards_into_the_sequence_score():
    # kl_in=reward: scores = reward + sum of token rewards = [1 - 0.5, 1 + 0] = [0.5, 1.0]
    # mean 0.75, deviations -+0.25, unbiased var = 0.125 / 1, std 0.353553 -> A = -+0.707107
    out = run("grpo", [1, 1], [[1, 1], [1, 1]], token_rewards=[[-0.5, 0.0], [0.0, 0.0]])
    assert_close(out.advantages, [[-0.707107] * 2, [0.707107] * 2])


def test_rloo_leave_one_out_baseline_ignores_not_applicable_siblings():
    # group [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - (1 + 0 + 1) / 3 = -2/3
    assert first_token(run("rloo", [1, 0, 0, 1], group_size=4)) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # group [3, NaN, 1, 2]: 3 - (1 + 2) / 2 = 1.5, 1 - (3 + 2) / 2 = -1.5, 2 - (3 + 1) / 2 = 0; NaN -> 0
    assert first_token(run("rloo", [3, NAN, 1, 2], group_size=4)) == pytest.approx([1.5, 0, -1.5, 0])
    # a valid reward whose only sibling is not applicable has no baseline -> 0
    assert first_token(run("rloo", [4, NAN])) == [0.0, 0.0]


# ------------------------------------------------------------------------------------------ REINFORCE++


def test_reinforce_pp_whitens_token_returns_over_the_batch():
    # gamma 1: returns row0 [1, 1, -], row1 [0, 0, 0]; over the 5 valid tokens mean 0.4,
    # population var = (2 * 0.36 + 3 * 0.16) / 5 = 0.24, std 0.489898
    # A: (1 - 0.4) / 0.489898 = 1.224745, (0 - 0.4) / 0.489898 = -0.816497
    out = run("reinforce_pp", [1, 0], [[1, 1, 0], [1, 1, 1]], group_size=1)
    assert_close(out.advantages, [[1.224745, 1.224745, 0], [-0.816497] * 3])
    assert out.returns.tolist() == [[1, 1, 0], [0, 0, 0]]


def test_reinforce_pp_discounts_token_rewards_and_skips_padding_gaps():
    # row0: token rewards [-0.1, -0.1, -0.1] + reward 1 on the last token = [-0.1, -0.1, 0.9], gamma 0.5:
    #   G2 = 0.9, G1 = -0.1 + 0.5 * 0.9 = 0.35, G0 = -0.1 + 0.5 * 0.35 = 0.075
    # row1: mask [1, 0, 1], reward 1: G2 = 1, t1 is skipped (not discounted), G0 = 0.5 * 1 = 0.5
    out = run("reinforce_pp", [1, 1], [[1, 1, 1], [1, 0, 1]], group_size=1, gamma=0.5,
              token_rewards=[[-0.1] * 3, [0.0] * 3])
    assert_close(out.returns, [[0.075, 0.35, 0.9], [0.5, 0.0, 1.0]], atol=1e-6)


def test_reinforce_pp_baseline_subtracts_group_mean_before_whitening():
    # groups [1, 0] and [3, 3] centred: 0.5, -0.5, 0, 0; whitening over 4 tokens: mean 0,
    # population var = (0.25 + 0.25) / 4 = 0.125, std 0.353553 -> A = 1.414214, -1.414214, 0, 0
    out = run("reinforce_pp_baseline", [1, 0, 3, 3])
    assert first_token(out) == pytest.approx([1.414214, -1.414214, 0, 0], abs=1e-5)


# ------------------------------------------------------------------------------------------ GAE


def test_gae_advantages_and_returns():
    # row0: values [0.5, 0.4, 0.3], reward 1 on the last token, gamma 0.9, lam 0.8 (gamma * lam = 0.72)
    #   t2: delta = 1 - 0.3 = 0.7                       A2 = 0.7
    #   t1: delta = 0.9 * 0.3 - 0.4 = -0.13             A1 = -0.13 + 0.72 * 0.7 = 0.374
    #   t0: delta = 0.9 * 0.4 - 0.5 = -0.14             A0 = -0.14 + 0.72 * 0.374 = 0.12928
    #   returns = A + V = [0.62928, 0.774, 1.0]
    # row1: mask [1, 1, 0], values [0.2, 0.1, 9.0 (padding, must be ignored)], reward 0
    #   t1: delta = 0 - 0.1 = -0.1                      A1 = -0.1
    #   t0: delta = 0.9 * 0.1 - 0.2 = -0.11             A0 = -0.11 + 0.72 * -0.1 = -0.182
    #   returns = [0.018, 0.0, 0]
    out = run("gae", [1, 0], [[1, 1, 1], [1, 1, 0]], group_size=1, gamma=0.9, lam=0.8, gae_whiten=False,
              values=[[0.5, 0.4, 0.3], [0.2, 0.1, 9.0]])
    assert_close(out.advantages, [[0.12928, 0.374, 0.7], [-0.182, -0.1, 0.0]], atol=1e-6)
    assert_close(out.returns, [[0.62928, 0.774, 1.0], [0.018, 0.0, 0.0]], atol=1e-6)


def test_gae_whitening_keeps_returns_raw_and_drops_not_applicable_rows():
    # the advantages of row0 above, 0.12928, 0.374, 0.7: whitened to mean 0, population std 1;
    # row1 (reward NaN) gets advantage 0 and takes no part in the whitening statistics
    out = run("gae", [1, NAN], [[1, 1, 1], [1, 1, 1]], group_size=1, gamma=0.9, lam=0.8,
              values=[[0.5, 0.4, 0.3], [5.0, 5.0, 5.0]])
    a = out.advantages[0]
    assert a.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert a.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    assert out.advantages[1].tolist() == [0.0, 0.0, 0.0]
    assert out.returns[0].tolist() == pytest.approx([0.62928, 0.774, 1.0], abs=1e-6)


def test_gae_without_values_is_a_clear_error():
    with pytest.raises(ValueError, match="values"):
        run("gae", [1.0, 0.0])


# ------------------------------------------------------------------------------------------ CPGD


def test_cpgd_weights():
    # groups [1, 0] (spread), [1, 1], [0, 0], [2, 2] (no spread); centred: 0.5, -0.5, then zeros
    rewards = [1, 0, 1, 1, 0, 0, 2, 2]
    # std: [1, 0] has unbiased std 0.707107 -> +-0.5 / 0.707107 = +-0.707107
    assert first_token(run("cpgd", rewards, cpgd_weight="std"))[:2] == pytest.approx([0.707107, -0.707107], abs=1e-5)
    # clip_filter: 4 groups / 1 informative = 4, capped at 3 -> +-1.5
    assert first_token(run("cpgd", rewards, cpgd_weight="clip_filter"))[:2] == [1.5, -1.5]
    # 2 groups / 1 informative = 2 (under the cap) -> +-1.0
    assert first_token(run("cpgd", [1, 0, 1, 1], cpgd_weight="clip_filter")) == [1.0, -1.0, 0.0, 0.0]
    assert first_token(run("cpgd", rewards, cpgd_weight="none"))[:2] == [0.5, -0.5]


# ------------------------------------------------------------------------------------------ ranks


def test_batch_statistics_are_exact_over_ranks():
    """Whole groups per rank; batch-level statistics must be those of the global batch, via `reduce`."""

    def rank_fn(rewards_by_rank, **kw):
        def fn(rank, sum_reduce, _max):
            r = torch.tensor(rewards_by_rank[rank])
            out = compute_advantages(cfg(**kw), r, ones(len(r)), 2, reduce=sum_reduce)
            return out.advantages[:, 0].tolist()
        return fn

    # GRPO batch std of all four rewards [0, 2 | 1, 1] = 0.816497 (see above); rank0 alone would use 1.414214
    assert run_ranks(2, rank_fn([[0.0, 2.0], [1.0, 1.0]], scale_rewards="batch"))[0] == \
        pytest.approx([-1.224745, 1.224745], abs=1e-5)
    # REINFORCE++ tokens [1, 0 | 0, 0]: mean 0.25, population var = (0.5625 + 3 * 0.0625) / 4 = 0.1875,
    # std 0.433013 -> 1.732051 and -0.577350; rank1 alone would see no spread and give zeros
    got = run_ranks(2, rank_fn([[1.0, 0.0], [0.0, 0.0]], advantage="reinforce_pp"))
    assert got == [pytest.approx([1.732051, -0.577350], abs=1e-5), pytest.approx([-0.577350] * 2, abs=1e-5)]
    # CPGD clip_filter: 2 groups over both ranks, 1 informative -> weight 2 (rank0 alone: weight 1)
    assert run_ranks(2, rank_fn([[1.0, 0.0], [1.0, 1.0]], advantage="cpgd", cpgd_weight="clip_filter"))[0] == \
        [1.0, -1.0]


# ------------------------------------------------------------------------------------------ contract


def test_inputs_are_not_modified():
    rewards = torch.tensor([1.0, NAN, 0.0, 2.0])
    token_rewards = torch.full((4, 2), -0.1)
    before = (rewards.clone(), token_rewards.clone())
    for advantage in ALL_ESTIMATORS:
        compute_advantages(cfg(advantage=advantage), rewards, ones(4, 2), 2, values=torch.zeros(4, 2),
                           token_rewards=token_rewards)
    assert torch.equal(rewards.isnan(), before[0].isnan()) and torch.equal(rewards.nan_to_num(), before[0].nan_to_num())
    assert torch.equal(token_rewards, before[1])


def test_custom_estimator_through_the_registry_and_the_config():
    name = "test_sign_of_reward"

    @register_advantage(name)
    def sign(inp):
        return EstimatorOutput(advantages=broadcast_to_tokens(torch.sign(sequence_scores(inp)), inp.mask))

    try:
        from vlrft.config import Config
        Config(algorithm=cfg(advantage=name)).validate(world_size=1)  # accepted once registered
        assert first_token(run(name, [2.0, -3.0, NAN, 0.0])) == [1.0, -1.0, 0.0, 0.0]
    finally:
        del ADVANTAGE_ESTIMATORS[name]


def test_infinite_reward_is_rejected_with_its_row():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        run("grpo", [1.0, float("inf")])


def test_unknown_estimator_names_the_choices():
    with pytest.raises(UserError, match="algorithm.advantage='nope'.*grpo"):
        run("nope", [1.0, 0.0])


def test_advantage_stats_are_sums_and_counts():
    # rewards [1, 0 | 1, NaN]: 3 valid, mean 2/3; 1 of 4 not applicable; group [1, NaN] has no spread
    stats = run("grpo", [1, 0, 1, NAN]).stats.means()
    assert stats["rewards/mean"] == pytest.approx(2 / 3)
    assert stats["rewards/not_applicable_frac"] == 0.25
    assert stats["rewards/zero_variance_group_frac"] == 0.5
    # GRPO of [1, 0]: +-0.707107 (unbiased std 0.707107 of deviations +-0.5)
    assert stats["advantages/abs_max"] == pytest.approx(0.707107, abs=1e-5)
    assert not any(math.isnan(v) for v in stats.values())

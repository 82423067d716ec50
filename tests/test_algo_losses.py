"""Policy and value losses against values computed by hand, and exact gradient accumulation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from algo_ranks import run_ranks
from vlrft.algo import LOSS_AGG_MODES, loss_denominators, policy_loss, value_loss
from vlrft.config import AlgorithmConfig
from vlrft.errors import UserError

LN = math.log


def cfg(**kw) -> AlgorithmConfig:
    return dataclasses.replace(AlgorithmConfig(), **kw)


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def logprobs_for(ratios: list[float]) -> torch.Tensor:
    """Current logprobs that give these ratios against old logprobs of 0."""
    return torch.tensor([[LN(r) for r in ratios]], requires_grad=True)


def loss_and_grad(c: AlgorithmConfig, ratios: list[float], advantages: list[float], mask=None, **kw):
    logp = logprobs_for(ratios)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor([mask], dtype=torch.bool)
    out = policy_loss(c, logp, torch.zeros_like(logp), row(*advantages), mask, **kw)
    out.loss.backward()
    return out.loss.item(), logp.grad[0].tolist(), out.stats.means()


# ------------------------------------------------------------------------------------------ PPO clip


def test_ppo_clip_loss_gradient_and_clip_fractions():
    # eps 0.2; old logprobs 0, so ratio = exp(logp)
    #   t0 ratio 1.0 A +1: -min(1.0, 1.0) = -1.0          grad -A*ratio/4 = -0.25
    #   t1 ratio 1.5 A +1: -min(1.5, 1.2) = -1.2  (high)  grad 0
    #   t2 ratio 0.5 A -1: -min(-0.5, -0.8) = 0.8 (low)   grad 0
    #   t3 ratio 1.1 A -1: -min(-1.1, -1.1) = 1.1         grad 1.1/4 = 0.275
    # token-mean = (-1.0 - 1.2 + 0.8 + 1.1) / 4 = -0.075
    loss, grad, stats = loss_and_grad(cfg(), [1.0, 1.5, 0.5, 1.1], [1, 1, -1, -1])
    assert loss == pytest.approx(-0.075, abs=1e-6)
    assert grad == pytest.approx([-0.25, 0.0, 0.0, 0.275], abs=1e-6)
    assert (stats["actor/clipfrac_high"], stats["actor/clipfrac_low"], stats["actor/clipfrac"]) == (0.25, 0.25, 0.5)
    # ratio mean (1 + 1.5 + 0.5 + 1.1) / 4 = 1.025, max 1.5
    assert stats["actor/ratio_mean"] == pytest.approx(1.025, abs=1e-6)
    assert stats["actor/ratio_max"] == pytest.approx(1.5, abs=1e-6)


def test_clip_fraction_counts_only_where_the_clip_binds_given_the_advantage_sign():
    # ratio 1.5 with A -1: -min(-1.5, -1.2) = 1.5, not clipped (the gradient still flows: 1.5/2 = 0.75)
    # ratio 0.5 with A +1: -min(0.5, 0.8) = -0.5, not clipped (gradient -0.5/2 = -0.25)
    loss, grad, stats = loss_and_grad(cfg(), [1.5, 0.5], [-1, 1])
    assert loss == pytest.approx((1.5 - 0.5) / 2, abs=1e-6)
    assert grad == pytest.approx([0.75, -0.25], abs=1e-6)
    assert stats["actor/clipfrac"] == 0.0


def test_clip_higher_uses_separate_low_and_high_bounds():
    # eps_low 0.2, eps_high 0.28, A +1: ratio 1.25 stays (-1.25), ratio 1.3 clips to -1.28 -> mean -1.265
    loss, grad, stats = loss_and_grad(cfg(clip_eps_high=0.28), [1.25, 1.3], [1, 1])
    assert loss == pytest.approx(-1.265, abs=1e-6)
    assert grad == pytest.approx([-0.625, 0.0], abs=1e-6)
    assert stats["actor/clipfrac_high"] == 0.5


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # c = 3: ratio 4 A -1: PPO gives -min(-4, -1.2) = 4, dual clip caps it at 3 (grad 0)
    #        ratio 2 A -1: 2 (< 3, untouched, grad 2/3);  ratio 4 A +1: -1.2 (clipped high, no dual clip)
    # token-mean = (3 + 2 - 1.2) / 3 = 1.266667
    loss, grad, stats = loss_and_grad(cfg(dual_clip=3.0), [4.0, 2.0, 4.0], [-1, -1, 1])
    assert loss == pytest.approx(3.8 / 3, abs=1e-6)
    assert grad == pytest.approx([0.0, 2 / 3, 0.0], abs=1e-6)
    assert stats["actor/dual_clipfrac"] == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------------------ aggregation


@pytest.mark.parametrize("mode, expected", [
    # per-token losses at ratio 1 are -A: row0 [-1, -2, pad], row1 [-3, -3, -3] (sum -12, 5 tokens, 2 seqs)
    ("token-mean", -12 / 5),                        # -2.4
    ("seq-mean-token-mean", (-3 / 2 + -9 / 3) / 2),  # (-1.5 - 3) / 2 = -2.25
    ("seq-mean-token-sum", (-3 + -9) / 2),            # -6
    ("seq-mean-token-sum-norm", -12 / (2 * 4)),       # max_tokens 4 -> -1.5
])
def test_aggregation_modes(mode, expected):
    logp = torch.zeros(2, 3, requires_grad=True)
    advantages = torch.tensor([[1.0, 2.0, 100.0], [3.0, 3.0, 3.0]])  # 100 sits on padding: ignored
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    out = policy_loss(cfg(loss_agg=mode), logp, torch.zeros(2, 3), advantages, mask, max_tokens=4)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


POLICY_SETUPS = {
    "ppo": dict(policy_loss="ppo", dual_clip=3.0, entropy_coef=0.01, kl_coef=0.1, tis_cap=2.0),
    "gspo": dict(policy_loss="gspo", gspo_clip_eps_low=0.05, gspo_clip_eps_high=0.05),
    "cpgd": dict(policy_loss="cpgd", cpgd_drift_coef=0.1),
}


def _random_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, t = 4, 5
    lengths = torch.tensor([5, 2, 4, 1])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return dict(
        logp=torch.randn(n, t, generator=g) * 0.3 - 1.0,
        old=torch.randn(n, t, generator=g) * 0.3 - 1.0,
        ref=torch.randn(n, t, generator=g) * 0.3 - 1.0,
        engine=torch.randn(n, t, generator=g) * 0.3 - 1.0,
        entropy=torch.rand(n, t, generator=g) * 2,
        adv=torch.randn(n, t, generator=g),
        mask=mask,
    )


def _loss(c: AlgorithmConfig, b: dict, logp: torch.Tensor, rows: slice, **kw) -> torch.Tensor:
    return policy_loss(c, logp[rows], b["old"][rows], b["adv"][rows], b["mask"][rows], entropy=b["entropy"][rows],
                       ref_logprobs=b["ref"][rows], engine_logprobs=b["engine"][rows], kl_coef=c.kl_coef,
                       max_tokens=5, **kw).loss


@pytest.mark.parametrize("method", sorted(POLICY_SETUPS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_with_caller_denominators_equals_the_single_batch(method, mode):
    c = cfg(loss_agg=mode, **POLICY_SETUPS[method])
    b = _random_batch()
    full = b["logp"].clone().requires_grad_(True)
    _loss(c, b, full, slice(0, 4)).backward()

    split = b["logp"].clone().requires_grad_(True)
    d = loss_denominators(b["mask"])  # over the whole mini-batch, once
    for rows in (slice(0, 2), slice(2, 4)):
        _loss(c, b, split, rows, num_tokens=d.num_tokens, num_seqs=d.num_seqs).backward()
    torch.testing.assert_close(split.grad, full.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_two_ranks_with_averaged_gradients_equal_the_single_batch(mode):
    """DDP averages gradients over ranks; world_size in the loss undoes that, with global denominators."""
    c = cfg(loss_agg=mode, **POLICY_SETUPS["ppo"])
    b = _random_batch(seed=1)
    full = b["logp"].clone().requires_grad_(True)
    _loss(c, b, full, slice(0, 4)).backward()

    def rank_fn(rank, sum_reduce, _max):
        rows = slice(2 * rank, 2 * rank + 2)
        d = loss_denominators(b["mask"][rows], reduce=sum_reduce)
        logp = b["logp"].clone().requires_grad_(True)
        _loss(c, b, logp, rows, num_tokens=d.num_tokens, num_seqs=d.num_seqs, world_size=2).backward()
        return logp.grad

    grads = run_ranks(2, rank_fn)
    torch.testing.assert_close((grads[0] + grads[1]) / 2, full.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", sorted(POLICY_SETUPS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_batch_gives_zero_loss_not_nan(method, mode):
    # dynamic sampling's worst case: nothing left to train on; must not divide 0 / 0
    c = cfg(loss_agg=mode, **POLICY_SETUPS[method])
    b = _random_batch()
    logp = b["logp"].clone().requires_grad_(True)
    b["mask"] = torch.zeros_like(b["mask"])
    loss = _loss(c, b, logp, slice(0, 4))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp.grad))


def test_advantages_are_used_as_given_not_normalised_again():
    # at ratio 1 the token-mean loss is -mean(A): 10x the advantages must give 10x the loss
    # (a loss that re-normalised advantages per micro-batch would return the same value twice)
    a = torch.tensor([[0.5, 1.5]])
    logp = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    one = policy_loss(cfg(), logp, torch.zeros(1, 2), a, mask).loss.item()
    ten = policy_loss(cfg(), logp, torch.zeros(1, 2), 10 * a, mask).loss.item()
    assert (one, ten) == (pytest.approx(-1.0), pytest.approx(-10.0))


# ------------------------------------------------------------------------------------------ GSPO


def test_gspo_uses_the_length_normalised_sequence_ratio():
    # token ratios 1.2 and 0.8: s = (1.2 * 0.8) ^ (1/2) = sqrt(0.96) = 0.979796, every token carries s
    # A +1: -min(0.979796, clip(...)) = -0.979796 (below 1 - eps_low, but A > 0: no clip)
    # gradient of -A * s wrt each logp_t is -A * s / |y| = -0.489898 (the sequence-level GSPO gradient)
    loss, grad, stats = loss_and_grad(cfg(policy_loss="gspo", loss_agg="seq-mean-token-mean"), [1.2, 0.8], [1, 1])
    assert loss == pytest.approx(-0.979796, abs=1e-6)
    assert grad == pytest.approx([-0.489898, -0.489898], abs=1e-6)
    assert stats["actor/clipfrac"] == 0.0 and stats["actor/gspo_seq_ratio"] == pytest.approx(0.979796, abs=1e-6)
    # A -1: s = 0.979796 < 1 - 3e-4, the clip binds -> loss -min(-0.979796, -0.9997) = 0.9997, gradient 0
    loss, grad, stats = loss_and_grad(cfg(policy_loss="gspo", loss_agg="seq-mean-token-mean"), [1.2, 0.8], [-1, -1])
    assert loss == pytest.approx(0.9997, abs=1e-6)
    assert grad == [0.0, 0.0]
    assert stats["actor/clipfrac_low"] == 1.0


# ------------------------------------------------------------------------------------------ CPGD


def test_cpgd_clips_the_log_ratio_and_its_gradient_is_ratio_free():
    # eps 0.2 -> bounds ln 1.2 = 0.182322 and ln 0.8 = -0.223144; per token -A * clipped(d), d = ln ratio
    #   ratio 1.5 A +1: d 0.405465 > ln 1.2 -> -0.182322, grad 0 (high)
    #   ratio 1.1 A +1: -ln 1.1 = -0.095310, grad -A / 4 = -0.25   (PPO would give -1.1 / 4)
    #   ratio 0.5 A -1: d -0.693147 < ln 0.8 -> ln 0.8 = -0.223144, grad 0 (low)
    #   ratio 0.9 A -1: ln 0.9 = -0.105361, grad +0.25
    # token-mean = (-0.182322 - 0.095310 - 0.223144 - 0.105361) / 4 = -0.151534
    loss, grad, stats = loss_and_grad(cfg(policy_loss="cpgd", cpgd_drift_coef=0.0), [1.5, 1.1, 0.5, 0.9], [1, 1, -1, -1])
    assert loss == pytest.approx(-0.151534, abs=1e-6)
    assert grad == pytest.approx([0.0, -0.25, 0.0, 0.25], abs=1e-6)
    assert (stats["actor/clipfrac_high"], stats["actor/clipfrac_low"]) == (0.25, 0.25)


def test_cpgd_policy_drift_value_is_k3_and_its_gradient_is_capped():
    # A = 0, so only the drift alpha * KL(pi_old || pi) counts; alpha 0.1, cap 2
    #   ratio 1.5: k3 = 1.5 - 1 - ln 1.5 = 0.094535; gradient coefficient rho - 1 = 0.5
    #   ratio 4.0: k3 = 4 - 1 - ln 4 = 1.613706;     gradient coefficient min(3, 2) = 2
    # token-mean loss = 0.1 * (0.094535 + 1.613706) / 2 = 0.085412; grads 0.1 * 0.5 / 2, 0.1 * 2 / 2
    loss, grad, stats = loss_and_grad(cfg(policy_loss="cpgd", cpgd_drift_coef=0.1), [1.5, 4.0], [0, 0])
    assert loss == pytest.approx(0.085412, abs=1e-6)
    assert grad == pytest.approx([0.025, 0.1], abs=1e-6)
    assert stats["actor/policy_drift_k3"] == pytest.approx((0.094535 + 1.613706) / 2, abs=1e-6)


# ------------------------------------------------------------------------------------------ extras


def test_truncated_importance_sampling_weight():
    # cap 2: old - engine = ln 3 -> min(3, 2) = 2; ln 0.5 -> 0.5; at ratio 1, A +1 the tokens give -2 and -0.5
    logp = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(cfg(tis_cap=2.0), logp, torch.zeros(1, 2), row(1, 1), mask,
                      engine_logprobs=torch.tensor([[-LN(3), -LN(0.5)]]))
    assert out.loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert out.stats.means()["actor/tis_weight_mean"] == pytest.approx(1.25, abs=1e-6)
    with pytest.raises(UserError, match="tis_cap"):
        policy_loss(cfg(tis_cap=2.0), logp, torch.zeros(1, 2), row(1, 1), mask)


def test_entropy_bonus():
    # A 0; entropy coef 0.01, token-mean entropy (2 + 4) / 2 = 3 -> loss = -0.03, d loss / d entropy = -0.005
    entropy = torch.tensor([[2.0, 4.0]], requires_grad=True)
    out = policy_loss(cfg(entropy_coef=0.01), torch.zeros(1, 2), torch.zeros(1, 2), row(0, 0),
                      torch.ones(1, 2, dtype=torch.bool), entropy=entropy)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.03, abs=1e-7)
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.005, -0.005]]))
    with pytest.raises(UserError, match="entropy"):
        policy_loss(cfg(entropy_coef=0.01), torch.zeros(1, 2), torch.zeros(1, 2), row(0, 0),
                    torch.ones(1, 2, dtype=torch.bool))


def test_kl_enters_the_loss_only_when_kl_in_is_loss():
    # k1 with logp - ref = [0.2, -0.1]: mean 0.05; kl_coef 0.1 -> +0.005 (A = 0, so that is the whole loss)
    logp, ref = torch.zeros(1, 2), torch.tensor([[-0.2, 0.1]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    args = (torch.zeros(1, 2), row(0, 0), mask)
    in_loss = policy_loss(cfg(kl_in="loss", kl_estimator="k1"), logp, *args, ref_logprobs=ref, kl_coef=0.1)
    assert in_loss.loss.item() == pytest.approx(0.005, abs=1e-7)
    # kl_in=reward: the KL was already shaped into the rewards, so it is logged but not added again
    in_reward = policy_loss(cfg(kl_in="reward", kl_estimator="k1"), logp, *args, ref_logprobs=ref, kl_coef=0.1)
    assert in_reward.loss.item() == 0.0
    assert in_reward.stats.means()["actor/kl_ref"] == pytest.approx(0.05, abs=1e-7)
    with pytest.raises(UserError, match="ref_logprobs"):
        policy_loss(cfg(kl_in="loss"), logp, *args, kl_coef=0.1)


def test_high_entropy_token_masking_trains_only_the_top_fraction():
    # frac 0.5 of 4 valid tokens = 2: entropies [0.1, 0.9, 0.5, 0.3] keep t1 and t2; the padded token
    # with entropy 5 is never chosen. At ratio 1, A +1: loss = (-1 - 1) / (4 * 0.5) = -1; grads -1/2 on t1, t2
    logp = torch.zeros(1, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    out = policy_loss(cfg(high_entropy_token_frac=0.5), logp, torch.zeros(1, 5), torch.ones(1, 5), mask,
                      entropy=torch.tensor([[0.1, 0.9, 0.5, 0.3, 5.0]]))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert logp.grad[0].tolist() == [0.0, -0.5, -0.5, 0.0, 0.0]
    assert out.stats.means()["actor/trained_token_frac"] == 0.5


def test_approx_kl_to_old_policy_is_k3():
    # ratio 2: k3 = 2 - 1 - ln 2 = 0.306853; ratio 1: 0 -> mean 0.153426
    _, _, stats = loss_and_grad(cfg(), [2.0, 1.0], [0, 0])
    assert stats["actor/approx_kl_old_k3"] == pytest.approx(0.153426, abs=1e-6)


def test_unknown_policy_loss_names_the_choices():
    with pytest.raises(UserError, match="policy_loss='nope'.*ppo"):
        loss_and_grad(cfg(policy_loss="nope"), [1.0], [1.0])


# ------------------------------------------------------------------------------------------ value loss


def test_clipped_value_loss():
    # clip 0.2, token-mean over 3 tokens:
    #   V 1.0, V_old 0.8, R 1.5: (V-R)^2 = 0.25; clipped V = 0.8 + 0.2 = 1.0 -> 0.25; 0.5 * 0.25 = 0.125
    #   V 2.0, V_old 1.0, R 1.0: (V-R)^2 = 1.0;  clipped V = 1.2 -> 0.04;           0.5 * 1.0 = 0.5
    #   V 2.0, V_old 1.0, R 3.0: (V-R)^2 = 1.0;  clipped V = 1.2 -> 3.24 (binds);   0.5 * 3.24 = 1.62
    # loss = (0.125 + 0.5 + 1.62) / 3 = 0.748333; grads (V-R)/3 = -0.166667, 0.333333, and 0 where clipped
    values = torch.tensor([[1.0, 2.0, 2.0]], requires_grad=True)
    out = value_loss(values, torch.tensor([[0.8, 1.0, 1.0]]), torch.tensor([[1.5, 1.0, 3.0]]),
                     torch.ones(1, 3, dtype=torch.bool), clip=0.2)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.748333, abs=1e-6)
    torch.testing.assert_close(values.grad, torch.tensor([[-1 / 6, 1 / 3, 0.0]]))
    assert out.stats.means()["critic/value_clipfrac"] == pytest.approx(1 / 3)


def test_value_loss_masks_padding_and_honours_caller_denominator():
    # one valid token: 0.5 * (2 - 0)^2 = 2; with num_tokens 4 (the mini-batch's count) -> 0.5
    values = torch.tensor([[2.0, 50.0]])
    mask = torch.tensor([[1, 0]], dtype=torch.bool)
    out = value_loss(values, values, torch.zeros(1, 2), mask, clip=0.2, num_tokens=4)
    assert out.loss.item() == 0.5

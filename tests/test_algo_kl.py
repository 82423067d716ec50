"""KL estimators, the KL-in-reward penalty and both KL controllers, against values computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vlrft.algo import AdaptiveKLController, FixedKLController, kl_estimate, kl_reward_penalty, make_kl_controller
from vlrft.config import AlgorithmConfig

# d = logp - logp_ref = [0.5, -0.5, 0]
LOGP = torch.tensor([0.5, -0.5, 0.0])
REF = torch.zeros(3)


@pytest.mark.parametrize("kind, expected", [
    ("k1", [0.5, -0.5, 0.0]),                  # d
    ("k2", [0.125, 0.125, 0.0]),               # d^2 / 2 = 0.25 / 2
    # exp(-d) - 1 + d: exp(-0.5) - 0.5 = 0.606531 - 0.5 = 0.106531; exp(0.5) - 1.5 = 1.648721 - 1.5 = 0.148721
    ("k3", [0.106531, 0.148721, 0.0]),
])
def test_kl_estimators(kind, expected):
    assert kl_estimate(LOGP, REF, kind).tolist() == pytest.approx(expected, abs=1e-6)


def test_k3_is_never_negative_and_finite_for_extreme_log_ratios():
    out = kl_estimate(torch.tensor([-1000.0, 1000.0]), torch.zeros(2), "k3")
    assert torch.isfinite(out).all() and (out >= 0).all()


def test_k3_is_clamped_to_ten_by_default_as_verl_and_openrlhf_do():
    # d = -5 (policy far below the reference): k3 = exp(5) - 6 = 142.41, gradient 1 - exp(5) = -147.41
    logp = torch.tensor([-5.0, -0.5], requires_grad=True)
    kl_estimate(logp, torch.zeros(2), "k3").sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1 - math.exp(0.5)])  # the clamped token adds no gradient
    assert kl_estimate(logp, torch.zeros(2), "k3").tolist() == pytest.approx([10.0, math.exp(0.5) - 1.5])
    assert AlgorithmConfig().kl_k3_clamp == 10.0


def test_k3_clamp_off_keeps_the_raw_estimate_and_its_gradient():
    logp = torch.tensor([-5.0], requires_grad=True)
    value = kl_estimate(logp, torch.zeros(1), "k3", k3_clamp=None)
    value.sum().backward()
    assert value.item() == pytest.approx(math.exp(5) - 6) and logp.grad.item() == pytest.approx(1 - math.exp(5))


def test_the_k3_clamp_reaches_the_loss_and_the_reward_penalty():
    from vlrft.algo import policy_loss

    logp, ref, mask = torch.tensor([[-5.0]], requires_grad=True), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
    for clamp, expected in ((10.0, 10.0), (None, math.exp(5) - 6)):
        cfg = dataclasses.replace(AlgorithmConfig(), kl_in="loss", kl_k3_clamp=clamp)
        out = policy_loss(cfg, logp, logp.detach(), torch.zeros(1, 1), mask, ref_logprobs=ref, kl_coef=1.0)
        assert out.loss.item() == pytest.approx(expected, rel=1e-5)
        penalty = kl_reward_penalty(logp, ref, mask, 1.0, "k3", clamp)
        assert penalty.item() == pytest.approx(-expected, rel=1e-5)


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(LOGP, REF, "k4")


def test_kl_reward_penalty_is_negative_coef_times_kl_on_valid_tokens():
    # k1, coef 0.1, mask [1, 1, 0] -> [-0.05, 0.05, 0]
    out = kl_reward_penalty(LOGP, REF, torch.tensor([1, 1, 0]), 0.1, "k1")
    assert out.tolist() == pytest.approx([-0.05, 0.05, 0.0])


def test_fixed_controller_keeps_its_value():
    ctl = FixedKLController(value=0.05)
    ctl.update(current_kl=10.0, n_steps=100)
    assert ctl.value == 0.05


def test_adaptive_controller_follows_ziegler_and_resumes_from_its_state():
    ctl = AdaptiveKLController(value=0.1, target=0.1, horizon=100)
    ctl.update(current_kl=0.15, n_steps=10)  # error clip(0.15/0.1 - 1 = 0.5, +-0.2) = 0.2 -> x(1 + 0.2 * 10/100) = 0.102
    assert ctl.value == pytest.approx(0.102)
    ctl.update(current_kl=0.05, n_steps=10)  # error -0.5 -> -0.2 -> x0.98 -> 0.09996
    assert ctl.value == pytest.approx(0.09996)
    resumed = AdaptiveKLController(value=0.1, target=0.1, horizon=100)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == pytest.approx(0.09996)


def test_make_kl_controller_from_config():
    base = AlgorithmConfig(kl_coef=0.02)
    assert make_kl_controller(base) == FixedKLController(value=0.02)
    adaptive = make_kl_controller(dataclasses.replace(base, kl_controller="adaptive", kl_target=6.0, kl_horizon=500))
    assert adaptive == AdaptiveKLController(value=0.02, target=6.0, horizon=500)

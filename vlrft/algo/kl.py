"""KL estimators between the policy and a reference, and the controllers that set the KL coefficient.

KL control happens in exactly one place per run, chosen by `algorithm.kl_in`: "reward" shapes the
per-token rewards with `kl_reward_penalty` before advantages are computed, "loss" adds the
estimate to the policy loss (`vlrft.algo.losses.policy_loss`). The other path stays off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlrft.config import AlgorithmConfig

KL_ESTIMATORS = ("k1", "k2", "k3")


# verl (`low_var_kl`) and OpenRLHF clamp the k3 value to +-10: far below the reference (d = -5)
# k3 = exp(5) - 6 = 142 with gradient -147 per token, and one such token outweighs the rest of the batch.
K3_CLAMP = 10.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str, k3_clamp: float | None = K3_CLAMP) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With d = logp - logp_ref: k1 = d (unbiased, can be negative), k2 = d^2 / 2 (low variance,
    biased), k3 = exp(-d) - 1 + d (unbiased and never negative). d is clamped to [-20, 20] so
    that exp never overflows to inf, and k3 to [-k3_clamp, k3_clamp] (`algorithm.kl_k3_clamp`,
    None = off) as verl and OpenRLHF do: a clamped token contributes no gradient.
    """
    d = (logprobs - ref_logprobs).clamp(-20.0, 20.0)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        k3 = torch.exp(-d) - 1.0 + d
        return k3 if k3_clamp is None else k3.clamp(-k3_clamp, k3_clamp)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def kl_reward_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, coef: float, kind: str,
                      k3_clamp: float | None = K3_CLAMP) -> Tensor:
    """Per-token rewards -coef * KL for `kl_in: reward` (zero on padding); pass as `token_rewards`."""
    kl = kl_estimate(logprobs.detach(), ref_logprobs.detach(), kind, k3_clamp)
    return -coef * kl * mask.to(kl.dtype)


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so both controllers are driven the same way."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Adaptive coefficient of Ziegler et al. 2019 (arXiv:1909.08593): steer the measured KL to `target`.

    value <- value * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)
    """

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # the coefficient is the only state; resume must restore it (docs/design.md, "Resume")
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(cfg: AlgorithmConfig) -> FixedKLController | AdaptiveKLController:
    """The controller named by `algorithm.kl_controller`, starting at `algorithm.kl_coef`."""
    if cfg.kl_controller == "adaptive":
        return AdaptiveKLController(value=cfg.kl_coef, target=cfg.kl_target, horizon=cfg.kl_horizon)
    return FixedKLController(value=cfg.kl_coef)

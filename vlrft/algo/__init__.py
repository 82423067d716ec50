"""Algorithms: advantage estimators, policy and value losses, KL estimators and controllers, reward shaping.

Pure torch and independent of the trainer. One step uses them in this order:

    rewards = clip_rewards(rewards + overlong_penalty(lengths, max_new, buf, pen), cfg.reward_clip)
    token_rewards = kl_reward_penalty(old_logp, ref_logp, mask, ctl.value, cfg.kl_estimator)  # kl_in: reward only
    adv = compute_advantages(cfg, rewards, mask, group_size, values=..., token_rewards=..., reduce=all_reduce_sum)
    d = loss_denominators(mini_batch_mask, reduce=all_reduce_sum)                                # once per mini-batch
    out = policy_loss(cfg, logp, old_logp, adv.advantages[mb], mask[mb], kl_coef=ctl.value,
                      num_tokens=d.num_tokens, num_seqs=d.num_seqs, max_tokens=max_new, world_size=W)
    out.loss.backward()
"""

from vlrft.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInput,
    AdvantageResult,
    EstimatorOutput,
    compute_advantages,
    register_advantage,
)
from vlrft.algo.groups import group_moments, zero_variance_groups
from vlrft.algo.kl import AdaptiveKLController, FixedKLController, kl_estimate, kl_reward_penalty, make_kl_controller
from vlrft.algo.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossDenominators,
    LossOutput,
    Surrogate,
    aggregate,
    loss_denominators,
    policy_loss,
    register_policy_loss,
    value_loss,
    zero_advantage_rows_add_nothing,
)
from vlrft.algo.shaping import RunningMoments, clip_rewards, expand_groups, overlong_penalty
from vlrft.algo.stats import Stats

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AdvantageInput", "AdvantageResult", "EstimatorOutput", "compute_advantages",
    "register_advantage", "group_moments", "zero_variance_groups", "AdaptiveKLController", "FixedKLController",
    "kl_estimate", "kl_reward_penalty", "make_kl_controller", "LOSS_AGG_MODES", "POLICY_LOSSES",
    "LossDenominators", "LossOutput", "Surrogate", "aggregate", "loss_denominators", "policy_loss",
    "register_policy_loss", "value_loss", "zero_advantage_rows_add_nothing", "RunningMoments", "clip_rewards",
    "expand_groups", "overlong_penalty", "Stats",
]

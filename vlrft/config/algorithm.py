"""The `algorithm:` section: advantage estimator, policy loss, KL control and reward shaping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlrft.config.options import option


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss, KL control and reward shaping (docs/design.md has the formulas)."""

    advantage: str = option(
        "grpo", "advantage estimator: grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, cpgd; a name "
        "added with vlrft.algo.register_advantage; or 'module:function' / 'path.py:function'")
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "GRPO's divisor: the group's std ('group'), the batch's std ('batch'), or none (Dr. GRPO)")
    policy_loss: str = option(
        "ppo", "policy loss: ppo, gspo, cpgd; a name added with vlrft.algo.register_policy_loss; or "
        "'module:function' / 'path.py:function'")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = option(
        "token-mean", "how token losses become one number: mean over all tokens (DAPO), mean of per-sequence means "
        "(GRPO paper), or sums (Dr. GRPO: seq-mean-token-sum-norm divides by max_new_tokens)")
    clip_eps_low: float = option(0.2, "PPO clip: the ratio may fall to 1 - clip_eps_low")
    clip_eps_high: float = option(0.2, "PPO clip: the ratio may rise to 1 + clip_eps_high (DAPO clip-higher: 0.28)")
    dual_clip: float | None = option(None, "dual-clip PPO: bound the loss of negative advantages at this times "
                                     "the advantage (e.g. 3.0); null = off")
    kl_coef: float = option(0.0, "beta, the weight of KL(policy || reference); 0 = no KL and no reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = option("k3", "per-token KL estimate (Schulman): k1 = d, k2 = d^2/2, "
                                                      "k3 = exp(-d) - 1 + d with d = logp - logp_ref")
    kl_k3_clamp: float | None = option(10.0, "k3 is clamped to [-x, x] as verl and OpenRLHF do (a token far "
                                       "below the reference adds no huge gradient); null = off")
    kl_in: Literal["loss", "reward"] = option(
        "loss", "where the KL goes: added to the loss ('loss', GRPO) or subtracted from the rewards before "
        "advantages ('reward', PPO/RLHF)")
    kl_controller: Literal["fixed", "adaptive"] = option(
        "fixed", "'fixed' keeps kl_coef; 'adaptive' steers the measured KL to kl_target (Ziegler et al. 2019)")
    kl_target: float = option(0.1, "adaptive KL controller: the KL it steers to")
    kl_horizon: int = option(10000, "adaptive KL controller: horizon in completions (larger = slower changes)", minimum=1)
    entropy_coef: float = option(0.0, "entropy bonus: the loss subtracts this times the mean token entropy")
    router_aux_loss_coef: float = option(
        0.0, "MoE models (Qwen3-VL-MoE): weight of the routers' load-balancing loss (transformers' aux_loss over "
        "the trained rows' prompt and completion tokens, padding excluded) added to the policy loss; 0 = off (RL "
        "starts from a balanced model and takes small steps); the released models' training used 0.001. Full "
        "fine-tuning only: LoRA leaves the routers frozen, so > 0 with model.lora.rank > 0 is refused, as is > 0 "
        "for a model without routers")
    high_entropy_token_frac: float | None = option(
        None, "train only on this top fraction of tokens by entropy (the 80/20 rule paper: 0.2); null = all")
    tis_cap: float | None = option(
        None, "truncated importance sampling: weight each token by min(p_policy / p_engine, tis_cap) to correct "
        "the engine/trainer mismatch (e.g. 2.0); null = off")
    gamma: float = option(1.0, "discount of token returns (REINFORCE++, GAE)")
    lam: float = option(1.0, "GAE lambda")
    value_clip: float = option(0.2, "critic: new values may move this far from the old ones before the clipped "
                               "loss takes over")
    value_coef: float = option(0.5, "weight of the critic's loss")
    overlong_buffer: int = option(0, "DAPO overlong penalty: it ramps up over the last this-many tokens before "
                                  "max_new_tokens; 0 = off", minimum=0)
    overlong_penalty: float = option(1.0, "DAPO overlong penalty at and beyond max_new_tokens")
    reward_clip: float | None = option(None, "clip rewards to [-x, x] before advantages; null = off")
    normalize_rewards: bool = option(False, "normalise rewards by their running mean and std (checkpointed)")
    mask_truncated: bool = option(False, "completions that hit max_new_tokens get no gradient (they still count "
                                  "in their group's statistics)")
    dynamic_sampling: bool = option(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and "
                                    "refill with new prompts")
    max_refill_rounds: int = option(4, "dynamic sampling: at most this many extra rollout rounds per step", minimum=0)
    adv_eps: float = option(1e-6, "added to every std an advantage is divided by (GRPO, batch scale, whitening)")
    gae_whiten: bool = option(True, "whiten GAE advantages once over the whole batch (all ranks), as PPO does")
    # GSPO clips the length-normalised sequence ratio, which moves far less than token ratios (paper: 3e-4 / 4e-4)
    gspo_clip_eps_low: float = option(3e-4, "GSPO: the sequence ratio may fall to 1 - this")
    gspo_clip_eps_high: float = option(4e-4, "GSPO: the sequence ratio may rise to 1 + this")
    # CPGD (arXiv:2505.12504): advantage weight after group-mean centring: "std" (divide by the group std),
    # "clip_filter" (multiply by groups / groups-with-nonzero-variance, capped at cpgd_weight_cap), "none"
    cpgd_weight: Literal["std", "clip_filter", "none"] = option(
        "std", "CPGD advantage weight after group-mean centring: divide by the group std, multiply by groups / "
        "groups-with-nonzero-variance ('clip_filter'), or none")
    cpgd_weight_cap: float = option(3.0, "CPGD clip_filter: the weight's upper bound")
    cpgd_drift_coef: float = option(0.01, "CPGD: alpha, weight of the policy-drift term KL(pi_old || pi_theta); "
                                    "0 = off")
    cpgd_drift_clip: float = option(2.0, "CPGD: cap on (ratio - 1) in the drift gradient, as in the reference "
                                    "implementation")


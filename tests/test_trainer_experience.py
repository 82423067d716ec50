"""From rollouts to advantages: masks and scores the trainer builds before the update."""

from __future__ import annotations

import torch

from vlrft.config import AlgorithmConfig
from vlrft.trainer.experience import score_advantages, training_masks


def test_a_masked_truncated_row_is_scored_like_its_siblings_when_kl_is_in_the_reward():
    """mask_truncated removes a row's gradient, not its KL term: group statistics compare like with like."""
    algo = AlgorithmConfig(advantage="grpo", kl_in="reward", kl_coef=0.1, kl_estimator="k1", mask_truncated=True)
    completions = [[5, 6, 7]] * 4
    token_mask, loss_mask = training_masks(completions, [False, False, False, True], algo.mask_truncated)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    old = torch.full((4, 3), -1.0)
    ref = torch.full((4, 3), -2.0)  # every row has the same KL: 3 tokens x 1.0
    result = score_advantages(algo, rewards, token_mask, 4, old=old, ref=ref, kl_coef=0.1)
    advantages = result.advantages[:, 0]
    # The same KL everywhere shifts every score equally: GRPO sees rewards [1, 0, 1, 0] (before the fix
    # the truncated row kept its raw reward and the others did not: [0.840, -1.137, 0.840]).
    assert torch.allclose(advantages[:3], torch.tensor([0.866, -0.866, 0.866]), atol=1e-3)
    assert loss_mask[3].sum() == 0 and loss_mask[:3].sum() == 9  # the truncated row still does not train


def test_without_mask_truncated_every_generated_token_trains():
    token_mask, loss_mask = training_masks([[1, 2], [3]], [True, False], mask_truncated=False)
    assert torch.equal(token_mask, loss_mask) and token_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]

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


def test_the_completions_log_averages_advantages_over_the_sampled_positions_of_a_multi_turn_row(tmp_path):
    """A 40 sampled + 20 observation + 40 sampled row (then padding): the logged advantage is the mean over the 80
    sampled positions. Before the fix the row's mask sum (80) stood in for a position: the first 80 positions were
    averaged, observation zeros and half of the second turn in, the last 20 sampled tokens out."""
    from types import SimpleNamespace

    from vlrft.trainer.experience import Experience
    from vlrft.trainer.step_report import completion_rows

    width = 110
    token_mask = torch.zeros(3, width)
    token_mask[0, :40] = 1.0
    token_mask[0, 60:100] = 1.0
    token_mask[1, :7] = 1.0  # a plain single-turn row
    advantages = torch.zeros(3, width)
    advantages[0, :40] = 1.0
    advantages[0, 40:60] = -3.0  # the observation: no sampled token, whatever value sits there
    advantages[0, 60:100] = 0.5
    advantages[0, 100:] = 9.0  # padding
    advantages[1, :7] = -0.25
    advantages[1, 7:] = 4.0
    # by hand: row 0 (40 * 1.0 + 40 * 0.5) / 80 = 0.75; row 1 -0.25; row 2 (no sampled token) 0.0
    expected = [0.75, -0.25, 0.0]
    exp = Experience(mask=token_mask.clone(), token_mask=token_mask, advantages=advantages, returns=None,
                     old_logprobs=None, ref_logprobs=None, engine_logprobs=None, values=None,
                     valid=torch.ones(3, dtype=torch.bool), advantage_stats=None)
    class Rows(SimpleNamespace):
        def __len__(self):
            return 3

    rollouts = Rows(prompt_index=[0, 0, 0], finish_reasons=["stop"] * 3, texts=["a", "b", ""], transcripts=[])
    prompts = SimpleNamespace(images=[[]], prompt_texts=["q"], samples=[SimpleNamespace(answer="1")])
    collected = SimpleNamespace(rollouts=rollouts, prompts=prompts, rewards=torch.tensor([1.0, 0.0, 0.0]),
                                per_function={"acc": torch.tensor([1.0, 0.0, 0.0])})
    rows = completion_rows(collected, exp, step=1, output_dir=tmp_path, max_rows=3)
    assert [round(row.advantage, 6) for row in rows] == expected
    assert all("weight_version" not in row.extra for row in rows)  # a colocated engine: always the current weights
    rollouts.weight_versions = [4, 4, 3]  # rollout servers: the version that sampled each row
    rows = completion_rows(collected, exp, step=1, output_dir=tmp_path, max_rows=3)
    assert [row.extra["weight_version"] for row in rows] == [4, 4, 3]

"""Single- and multi-turn rows take one path through the trainer: a single-turn row is a trajectory of one turn.

`Rollouts` carries the multi-turn fields explicitly (None for single-turn rows); the trainer reads them
through accessors that give a single-turn row's values (every token sampled, no tool images, no tool
reward), never by probing for attributes. The same rows built both ways give the same experience.
"""

from __future__ import annotations

import pytest
import torch

from vlrft.batch import build_sequences
from vlrft.config import AlgorithmConfig, DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.models.actor import ActorVL
from vlrft.models.loading import load_policy, load_processor
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, Rollouts
from vlrft.tokens import TokenSpec
from vlrft.tools.types import ToolStats
from vlrft.trainer.collect import Collected
from vlrft.trainer.experience import Batching, ExperienceDeps, make_experience, sequences_for

N = 2


def _collected(batch, rollouts: Rollouts, rewards: torch.Tensor) -> Collected:
    return Collected(prompts=batch, rollouts=rollouts, rewards=rewards, per_function={}, groups_seen=len(batch),
                     zero_std_groups=0, filled_zero_std=0, skipped_prompts=0, rounds=1)


def _as_one_turn_trajectories(rollouts: Rollouts) -> Rollouts:
    rows = len(rollouts)
    return Rollouts(n=rollouts.n, completion_ids=rollouts.completion_ids, finish_reasons=rollouts.finish_reasons,
                    logprobs=rollouts.logprobs, texts=rollouts.texts,
                    sampled_mask=[[1] * len(ids) for ids in rollouts.completion_ids],
                    observation_visual=[None] * rows, observation_images=[[] for _ in range(rows)], turns=[1] * rows,
                    tool_rewards=[0.0] * rows, tool_stats=[ToolStats() for _ in range(rows)],
                    transcripts=[[] for _ in range(rows)])


@pytest.fixture(scope="module")
def rows(tiny_vlm_dir, tmp_path_factory):
    from PIL import Image

    folder = tiny_vlm_dir("qwen2_vl")
    processor = load_processor(folder)
    model = load_policy(folder).eval()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    image = tmp_path_factory.mktemp("imgs") / "red.png"
    Image.new("RGB", (112, 112), (220, 30, 30)).save(image)
    batch = PromptEncoder(processor, DataConfig(min_pixels=784, max_pixels=3136)).encode(
        [Sample(id="a", prompt="<image>What is it?", images=[str(image)]), Sample(id="b", prompt="Count.")]).batch
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 3, 5, 9]  # different widths; row 3 is cut at max_new_tokens
    completions = [torch.randint(10, 200, (k,), generator=gen).tolist() for k in lengths]
    logprobs = [(-torch.rand(k, generator=gen)).tolist() for k in lengths]
    single = Rollouts(n=N, completion_ids=completions, finish_reasons=[FINISH_STOP] * 3 + [FINISH_LENGTH],
                      logprobs=logprobs, texts=["x"] * 4)
    actor = ActorVL(model, int(model.config.image_token_id), int(model.config.video_token_id))
    return batch, single, actor, tokens


def test_a_single_turn_row_reads_as_a_trajectory_of_one_turn(rows):
    _, single, _, _ = rows
    assert single.sampled == [[1] * len(ids) for ids in single.completion_ids]
    assert single.metrics() == {}  # no tool metrics without tools
    total = torch.tensor([1.0, -0.0, float("nan"), 0.5])
    assert single.with_tool_rewards(total) is total  # unchanged, a -0.0 included
    trajectories = _as_one_turn_trajectories(single)
    assert torch.equal(trajectories.with_tool_rewards(total).nan_to_num(), total.nan_to_num())


def test_single_turn_rows_and_the_same_rows_as_one_turn_trajectories_give_equal_experience(rows):
    batch, single, actor, tokens = rows
    rewards = torch.tensor([1.0, 0.0, 0.25, 0.75])
    batching = Batching(pad_id=tokens.pad_id, device=torch.device("cpu"), micro_batch=4)
    as_single = _collected(batch, single, rewards)
    as_turns = _collected(batch, _as_one_turn_trajectories(single), rewards)

    for subset in ([0, 1, 2, 3], [3, 0], [2]):
        plain = build_sequences(batch.prompt_ids, batch.visual, single.completion_ids, single.prompt_index,
                                tokens.pad_id, subset)  # the single-turn layout as it always was
        for seqs in (sequences_for(batching, as_single, subset), sequences_for(batching, as_turns, subset)):
            assert torch.equal(seqs.input_ids, plain.input_ids)
            assert torch.equal(seqs.attention_mask, plain.attention_mask)
            assert torch.equal(seqs.completion_mask, plain.completion_mask)
            assert seqs.prompt_width == plain.prompt_width and seqs.row_prompt == plain.row_prompt
            assert seqs.completion_visual is None

    algo = AlgorithmConfig(advantage="grpo", mask_truncated=True)
    deps = ExperienceDeps(algo=algo, group_size=N, batching=batching, temperature=1.0, kl_coef=0.0, old_policy=actor)
    torch.manual_seed(0)
    a = make_experience(deps, as_single)
    torch.manual_seed(0)
    b = make_experience(deps, as_turns)
    for name in ("mask", "token_mask", "advantages", "old_logprobs", "engine_logprobs", "valid"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.mask[3].sum() == 0 and a.token_mask.sum() == sum(len(c) for c in single.completion_ids)


def test_multi_turn_fields_follow_their_rows_through_select_and_concat(rows):
    _, single, _, _ = rows
    trajectories = _as_one_turn_trajectories(single)
    trajectories.turns[:] = [1, 2, 3, 4]
    part = trajectories.select_groups([1])
    assert part.turns == [3, 4] and part.sampled_mask == trajectories.sampled_mask[2:]
    both = Rollouts.concat([part, trajectories.select_groups([0])])
    assert both.turns == [3, 4, 1, 2] and both.tool_rewards == [0.0] * 4
    assert single.select_groups([1]).turns is None and Rollouts.concat([single, single]).sampled_mask is None
    with pytest.raises(ValueError, match="single- and multi-turn"):
        Rollouts.concat([single, trajectories])
    with pytest.raises(ValueError, match="3 turns"):
        Rollouts(n=N, completion_ids=[[1]] * 4, finish_reasons=[FINISH_STOP] * 4, turns=[1, 1, 1])

"""Token-budget micro-batches (`train.max_tokens_per_micro_batch`): the plan, and that training is unchanged.

The plan groups rows of similar length within the budget; the experience (old/reference
logprobs), the loss, its metrics and the trained weights equal those of row-count micro-batches,
in one process and across 2 DDP/FSDP2 ranks whose budgets form different numbers of micro-batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vlrft.batch import width_classes
from vlrft.config import load_config
from vlrft.errors import ConfigError
from vlrft.trainer.micro_batches import (RowLengths, by_row_count, by_token_budget, forward_tokens, padded_to_count,
                                         real_tokens)

sys.path.insert(0, str(Path(__file__).parent))

from budget_worker import LENGTHS, make_collected, train_step, write_images  # noqa: E402
from _torchrun import failure_output, torchrun  # noqa: E402
from _sharded_runs import needs_deepspeed  # noqa: E402  skips, with the reason, where deepspeed cannot import

REPO = Path(__file__).resolve().parents[1]


def lengths_of(prompt_lengths: list[int], completion_lengths: list[list[int]]) -> RowLengths:
    row_prompt = [g for g, group in enumerate(completion_lengths) for _ in group]
    return RowLengths(row_prompt, [prompt_lengths[g] for g in row_prompt], [c for g in completion_lengths for c in g])


def natural_lengths(seed: int) -> RowLengths:
    """8 prompts of 48-128 tokens, 8 completions each: a log-normal length per prompt and around it (stop at EOS)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(48, 129, (8,), generator=gen).tolist()
    means = 120 * torch.exp(0.6 * torch.randn(8, generator=gen))
    completions = [(m * torch.exp(0.35 * torch.randn(8, generator=gen))).round().clamp(1, 512).int().tolist()
                   for m in means]
    return lengths_of(prompts, completions)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_budget_groups_similar_lengths_within_the_budget_and_keeps_every_row_once(seed):
    lengths = natural_lengths(seed)
    rows = list(range(64))
    least = real_tokens(lengths, rows)  # each prompt once, every completion, no padding
    by_count = by_row_count(rows, 4)
    padded_rows = sum(forward_tokens(lengths, m, split_widths=False) for m in by_count)
    assert padded_rows >= 1.3 * least  # what one call per micro-batch of 4 rows costs here
    for split in (True, False):
        notes = []
        micro = by_token_budget(lengths, rows, 4096, on_oversized=lambda r, t: notes.append(r), split_widths=split)
        assert sorted(r for m in micro for r in m) == rows and not notes
        tokens = [forward_tokens(lengths, m, split_widths=split) for m in micro]
        assert max(tokens) <= 4096
        if split:  # completions in classes of similar length: a prompt's rows stay together, little padding
            assert sum(tokens) <= 1.1 * least and len(micro) < len(by_count) / 2
        else:  # one call per micro-batch (sharding strategies): padding about 10 % of the non-pad tokens
            assert sum(tokens) <= 1.13 * sum(real_tokens(lengths, m) for m in micro)
            assert sum(tokens) < 0.9 * padded_rows  # prompts run again in other micro-batches included


def test_a_row_over_the_budget_runs_alone_and_is_reported():
    lengths = lengths_of([10, 10], [[500, 5], [6, 4]])
    notes = []
    micro = by_token_budget(lengths, [0, 1, 2, 3], 100, on_oversized=lambda r, t: notes.append((r, t)))
    assert [0] in micro and notes == [(0, 510)]
    assert sorted(r for m in micro for r in m) == [0, 1, 2, 3]


def test_prompt_is_not_run_twice_when_that_costs_more_than_padding():
    # One long prompt: its four short rows stay together although their lengths differ by 4x.
    lengths = lengths_of([400], [[8, 2, 5, 3]])
    assert by_token_budget(lengths, [0, 1, 2, 3], 1000, split_widths=False) == [[0, 1, 2, 3]]
    assert by_token_budget(lengths, [0, 1, 2, 3], 1000) == [[0, 1, 2, 3]]


def test_width_classes_pad_little_and_weigh_each_call():
    lengths = [300, 12, 290, 10, 11, 150]
    classes = width_classes(lengths, call_tokens=32)
    assert sorted(i for c in classes for i in c) == list(range(6))
    assert [sorted(c) for c in classes] == [[0, 2], [5], [1, 3, 4]]
    assert width_classes([5, 4, 6], call_tokens=32) == [[2, 0, 1]]  # padding 3 tokens < another call


def test_fewer_micro_batches_than_the_other_ranks_split_then_fill():
    lengths = lengths_of([10], [[5, 4, 3]])
    grown = padded_to_count([[0, 1, 2]], 3, lengths)
    assert [m.rows for m in grown] == [[0], [1], [2]] or sorted(len(m.rows) for m in grown) == [1, 1, 1]
    assert not any(m.filler for m in grown)
    filled = padded_to_count([[0], [1]], 4, lengths)
    assert [m.filler for m in filled] == [False, False, True, True]
    assert filled[2].rows == [1]  # the cheapest row runs again, with weight 0


def test_negative_budget_is_refused():
    cfg = load_config(None, validate=False)
    cfg.train.max_tokens_per_micro_batch = -5
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        cfg.validate(world_size=1)


@pytest.fixture(scope="module")
def case(tiny_vlm_dir, tmp_path_factory):
    model = tiny_vlm_dir("qwen2_vl")
    images = write_images(tmp_path_factory.mktemp("budget_images"))
    collected, tokens = make_collected(model, images, list(range(len(LENGTHS))))
    return model, images, collected, tokens


@pytest.mark.parametrize("loss_agg,forwards,split", [("token-mean", None, True), ("seq-mean-token-mean", None, True),
                                                      ("token-mean", None, False), ("token-mean", 20, True)])
def test_token_budget_gives_the_same_experience_loss_metrics_and_weights(case, loss_agg, forwards, split):
    """Against row-count micro-batches each run as one padded call. `split`: completions in classes of similar
    length (`ActorVL.split_completion_widths`). `forwards`: another rank makes every phase run that many forwards
    (more than this rank has rows), so this rank splits its micro-batches and then runs fillers."""
    from vlrft.parallel.strategy import Strategy

    model, _, collected, tokens = case
    lengths = RowLengths.of(collected.prompts.prompt_ids, collected.rollouts.completion_ids,
                            collected.rollouts.prompt_index)
    budget = 120
    plan = by_token_budget(lengths, list(range(8)), budget, split_widths=split)  # the first mini-batch
    assert len(plan) > 2 and sorted(map(len, plan)) != [4, 4]  # really another partition than rows of 4
    exp_a, stats_a, actor_a = train_step(model, collected, tokens, Strategy(), max_tokens=0, loss_agg=loss_agg,
                                         split=False)
    agree = None if forwards is None else (lambda count: max(count, forwards))
    exp_b, stats_b, actor_b = train_step(model, collected, tokens, Strategy(), max_tokens=budget, loss_agg=loss_agg,
                                         agree=agree, split=split)
    torch.testing.assert_close(exp_b.old_logprobs, exp_a.old_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(exp_b.ref_logprobs, exp_a.ref_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(exp_b.advantages, exp_a.advantages, atol=1e-5, rtol=0)
    means_a, means_b = stats_a.means(), stats_b.means()
    assert means_a.keys() == means_b.keys() and {"actor/pg_loss", "actor/grad_norm", "actor/kl_ref"} <= means_a.keys()
    for k in means_a:
        assert abs(means_a[k] - means_b[k]) <= 1e-5 * max(1.0, abs(means_a[k])), k
    for (name, a), b in zip(actor_a.named_parameters(), actor_b.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
    from vlrft.models.loading import load_policy

    initial = dict(load_policy(model).named_parameters())
    moved = max(float((p - initial[n.removeprefix("model.")]).detach().abs().max())
                for n, p in actor_a.named_parameters())
    assert moved > 1e-3  # the steps changed the weights: the comparison is not vacuous


def test_completions_in_width_classes_equal_one_padded_call_in_values_and_gradients(case):
    from vlrft.batch import build_sequences
    from vlrft.models.actor import ActorVL
    from vlrft.models.loading import load_policy

    model_dir, _, collected, tokens = case
    model = load_policy(model_dir)
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    rows = [0, 1, 2, 3, 8, 9, 10, 11, 5]  # lengths 2-40, two image prompts and a text prompt with one row
    seqs = build_sequences(collected.prompts.prompt_ids, collected.prompts.visual, collected.rollouts.completion_ids,
                           collected.rollouts.prompt_index, tokens.pad_id, rows)

    def run(split: bool):
        actor.split_completion_widths = split
        model.zero_grad()
        out = actor.logprobs(seqs, temperature=0.9)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    actor.split_completion_widths = True
    classes = actor._width_classes(seqs)
    assert classes is not None and len(classes) >= 2
    (split_out, split_grads), (one_out, one_grads) = run(True), run(False)
    torch.testing.assert_close(split_out.logprobs, one_out.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(split_out.entropy, one_out.entropy, atol=1e-5, rtol=0)
    assert split_grads.keys() == one_grads.keys() and any("visual" in n for n in split_grads)
    for name in one_grads:
        torch.testing.assert_close(split_grads[name], one_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.distributed
@pytest.mark.slow  # a torchrun launch each, 25-40 s on 2 loaded cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", *(pytest.param(z, marks=needs_deepspeed) for z in ("zero2", "zero3"))])
def test_ranks_with_different_micro_batch_counts_train_like_one_process(case, tmp_path, strategy):
    from vlrft.parallel.strategy import Strategy

    model, images, collected, tokens = case
    out = tmp_path / "out.pt"
    proc = torchrun("budget_worker.py", str(model), str(images), strategy, str(out))
    assert proc.returncode == 0, failure_output(proc)
    result = torch.load(out)
    own = [counts[0] for counts in result["counts"]]  # the first plan (experience) of each rank
    assert own[0] != own[1], "the ranks must form different numbers of micro-batches for this test to mean anything"
    _, stats, single = train_step(model, collected, tokens, Strategy(), max_tokens=0, mini_batches=1, split=False)
    for name, p in single.named_parameters():
        torch.testing.assert_close(result["weights"][name], p.detach(), atol=1e-5, rtol=0, msg=name)
    means = stats.means()
    for k in ("actor/pg_loss", "actor/grad_norm"):
        if k in means:
            assert abs(result["means"][k] - means[k]) <= 1e-5 * max(1.0, abs(means[k])), k


def test_trainer_step_with_a_token_budget_equals_the_row_count_step(tmp_path, tiny_vlm_dir, tmp_path_factory,
                                                                    monkeypatch):
    """The config key reaches the trainer's phases: one `Trainer.train_step` (real hf rollouts) gives the update
    of row-count micro-batches."""
    import vlrft.trainer.experience as experience
    from examples.shapes import ShapesSpec, make_shapes
    from test_invariance import assert_same_step, one_step

    plans = []

    def recorded(*args, **kwargs):
        plans.append(by_token_budget(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(experience, "by_token_budget", recorded)
    shapes = make_shapes(tmp_path_factory.mktemp("shapes"), ShapesSpec(train_size=16, test_size=4))
    model = tiny_vlm_dir("qwen2_vl")
    rows = one_step(tmp_path / "a", model, shapes, "train.micro_batch_completions_per_rank=8")
    assert not plans
    budget = one_step(tmp_path / "b", model, shapes, "train.max_tokens_per_micro_batch=200")
    assert plans and all(sorted(r for m in plan for r in m) == list(range(16)) for plan in plans)
    assert any(1 < len(m) < 16 for m in plans[-1])  # rows grouped, and not all in one forward
    assert_same_step(rows, budget)
    assert rows[2]["actor/pg_loss"] == pytest.approx(budget[2]["actor/pg_loss"], abs=1e-5)


@pytest.fixture(scope="module")
def zero_advantage_case(case):
    """The same rollouts, with groups 0 and 2 scoring alike on every row (zero advantage under GRPO)."""
    model, images, _, _ = case
    collected, tokens = make_collected(model, images, list(range(len(LENGTHS))), constant_groups=(0, 2))
    return model, images, collected, tokens


@pytest.mark.parametrize("max_tokens", [0, 120])
@pytest.mark.slow
def test_rows_of_zero_advantage_are_left_out_and_the_update_is_the_same(zero_advantage_case, max_tokens,
                                                                        monkeypatch):
    """With no KL and no entropy bonus a zero-advantage row's loss and gradient are exactly 0: leaving it out of the
    forward/backward (the loss denominators still count it) gives the weights of training on every row."""
    import vlrft.trainer.update as update_module
    from vlrft.parallel.strategy import Strategy

    model, _, collected, tokens = zero_advantage_case
    forwarded = []
    planned = update_module.plan_micro_batches

    def recorded(*args, **kwargs):
        micro = planned(*args, **kwargs)
        forwarded.append(sorted(r for m in micro if not m.filler for r in m.rows))
        return micro

    monkeypatch.setattr(update_module, "plan_micro_batches", recorded)
    _, stats, skipped = train_step(model, collected, tokens, Strategy(), max_tokens=max_tokens, plain=True)
    assert forwarded == [[4, 5, 6, 7], [12, 13, 14, 15]]  # each mini-batch's varied group only (groups 1 and 3)
    assert stats.means()["actor/zero_advantage_rows_skipped"] == 0.5
    forwarded.clear()
    _, full_stats, full = train_step(model, collected, tokens, Strategy(), max_tokens=max_tokens, plain=True,
                                     skip_zero_advantage=False)
    assert forwarded == [list(range(8)), list(range(8, 16))] and "actor/zero_advantage_rows_skipped" not in full_stats.means()
    for (name, a), b in zip(full.named_parameters(), skipped.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
    assert stats.means()["actor/grad_norm"] == pytest.approx(full_stats.means()["actor/grad_norm"], rel=1e-5)
    assert stats.means()["actor/grad_norm"] > 0  # the varied groups trained: the comparison is not vacuous


@pytest.mark.slow
def test_rows_are_kept_where_a_zero_advantage_row_still_has_a_loss(zero_advantage_case):
    """KL in the loss and an entropy bonus train every row: nothing is left out (train_step's default losses)."""
    from vlrft.parallel.strategy import Strategy

    model, _, collected, tokens = zero_advantage_case
    _, stats, _ = train_step(model, collected, tokens, Strategy(), max_tokens=0)
    assert "actor/zero_advantage_rows_skipped" not in stats.means()


def test_which_losses_let_zero_advantage_rows_out():
    from vlrft.algo import register_policy_loss, zero_advantage_rows_add_nothing
    from vlrft.algo.losses import POLICY_LOSSES, ppo_surrogate

    def cfg(*overrides):
        return load_config(None, list(overrides), validate=False).algorithm

    assert zero_advantage_rows_add_nothing(cfg(), kl_coef=0.0)
    assert zero_advantage_rows_add_nothing(cfg("algorithm.policy_loss=gspo"), kl_coef=0.0)
    assert zero_advantage_rows_add_nothing(cfg("algorithm.kl_in=reward"), kl_coef=0.1)  # KL already in the advantage
    assert not zero_advantage_rows_add_nothing(cfg(), kl_coef=0.1)
    assert not zero_advantage_rows_add_nothing(cfg("algorithm.entropy_coef=0.01"), kl_coef=0.0)
    assert not zero_advantage_rows_add_nothing(cfg("algorithm.high_entropy_token_frac=0.2"), kl_coef=0.0)
    assert zero_advantage_rows_add_nothing(cfg("algorithm.policy_loss=cpgd", "algorithm.cpgd_drift_coef=0"), 0.0)
    assert not zero_advantage_rows_add_nothing(cfg("algorithm.policy_loss=cpgd", "algorithm.cpgd_drift_coef=0.1"), 0.0)
    original = POLICY_LOSSES["ppo"]
    try:  # a surrogate registered over a built-in name may add terms of its own
        register_policy_loss("ppo", override=True)(lambda *args: ppo_surrogate(*args))
        assert not zero_advantage_rows_add_nothing(cfg(), kl_coef=0.0)
    finally:
        POLICY_LOSSES["ppo"] = original


@pytest.mark.distributed
@pytest.mark.slow  # a torchrun launch each, 25-40 s on 2 loaded cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", pytest.param("zero3", marks=needs_deepspeed)])
def test_a_rank_with_only_zero_advantage_rows_keeps_step_and_trains_like_one_process(zero_advantage_case, tmp_path,
                                                                                     strategy):
    """Rank 0 holds the two zero-advantage groups: it trains no row, yet runs a filler beside each of rank 1's
    micro-batches (no hang: sharded blocks gather on every rank), and the weights equal one process training on
    every row."""
    from vlrft.parallel.strategy import Strategy

    model, images, collected, tokens = zero_advantage_case
    out = tmp_path / "out.pt"
    proc = torchrun("budget_worker.py", str(model), str(images), strategy, str(out), "0", "zero_advantage")
    assert proc.returncode == 0, failure_output(proc)
    result = torch.load(out)
    assert result["counts"][0] == [0] and result["counts"][1][0] >= 1  # update's own micro-batch counts per rank
    assert result["means"]["actor/zero_advantage_rows_skipped"] == 0.5
    _, _, single = train_step(model, collected, tokens, Strategy(), max_tokens=0, mini_batches=1, split=False,
                              plain=True, skip_zero_advantage=False)
    for name, p in single.named_parameters():
        torch.testing.assert_close(result["weights"][name], p.detach(), atol=1e-5, rtol=0, msg=name)

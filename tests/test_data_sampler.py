"""PromptSampler: epoch roll-over, seeded reshuffles, rank split, exact resume."""

import pytest

from vlrft.data import PromptSampler
from vlrft.errors import UserError


def test_unshuffled_order_rolls_over_epochs():
    sampler = PromptSampler(num_samples=5, batch_size=2, seed=0, shuffle=False)
    steps = [sampler.next_indices() for _ in range(4)]
    assert steps == [[0, 1], [2, 3], [4, 0], [1, 2]]  # step 3 straddles epochs 0 and 1
    assert sampler.epoch == 1 and sampler.position == 8


def test_every_epoch_is_a_fresh_seeded_permutation():
    sampler = PromptSampler(num_samples=6, batch_size=3, seed=7)
    epochs = [sampler.next_indices() + sampler.next_indices() for _ in range(3)]
    assert all(sorted(e) == list(range(6)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # reshuffled each epoch
    again = PromptSampler(num_samples=6, batch_size=3, seed=7)
    assert again.next_indices() + again.next_indices() == epochs[0]  # same seed, same order
    other = PromptSampler(num_samples=6, batch_size=3, seed=8)
    assert other.next_indices() + other.next_indices() != epochs[0]


def test_ranks_take_contiguous_shares_of_the_global_stream():
    single = PromptSampler(num_samples=10, batch_size=4, seed=3)
    ranks = [PromptSampler(num_samples=10, batch_size=4, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        expected = single.next_indices()
        assert ranks[0].next_indices() + ranks[1].next_indices() == expected


def test_resume_continues_exactly():
    run = PromptSampler(num_samples=7, batch_size=3, seed=1)
    for _ in range(3):
        run.next_indices()
    state = run.state_dict()
    expected = [run.next_indices() for _ in range(4)]
    resumed = PromptSampler(num_samples=7, batch_size=3, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(4)] == expected


def test_resume_refuses_other_data_or_seed():
    state = PromptSampler(num_samples=7, batch_size=3, seed=1).state_dict()
    with pytest.raises(UserError, match="saved with num_samples=7 but this run has num_samples=8"):
        PromptSampler(num_samples=8, batch_size=3, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="saved with seed=1 but this run has seed=2"):
        PromptSampler(num_samples=7, batch_size=3, seed=2).load_state_dict(state)


def test_invalid_arguments():
    with pytest.raises(UserError, match="no usable samples"):
        PromptSampler(num_samples=0, batch_size=2, seed=0)
    with pytest.raises(UserError, match=r"prompts per step \(3\) must be a positive multiple of the number of ranks"):
        PromptSampler(num_samples=10, batch_size=3, seed=0, world_size=2)

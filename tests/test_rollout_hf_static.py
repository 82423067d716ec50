"""The group decoder's preallocated (static) KV cache gives the same rollouts as the dynamic one.

These exercise decode steps through transformers' layers (`lean_decode=False`); the lean step has
its own tests (test_rollout_lean_decode.py).
"""

import pytest
import torch

from _rollout_helpers import engine_setup, solid_png
from vlrft.data import Sample
from vlrft.models.loading import load_policy
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from vlrft.rollout.hf import HFEngine


@pytest.fixture(scope="module")
def setup(tiny_vlm_dir, tmp_path_factory):
    red = solid_png(tmp_path_factory.mktemp("imgs"), "red", (220, 30, 30))
    samples = [Sample(id="a", prompt="<image>What color is the shape?", images=[red]),
               Sample(id="b", prompt="Say something rather longer than the others."),
               Sample(id="c", prompt="Hi")]
    return engine_setup(tiny_vlm_dir("qwen2_5_vl"), samples)


def _run(setup, sampling, **engine_options):
    processor, model, tokens, batch = setup
    torch.manual_seed(0)
    engine_options.setdefault("lean_decode", False)
    return HFEngine(lambda: model, processor, tokens, share_prompts=True, **engine_options).generate(batch, sampling)


def _assert_same(a, b):
    assert a.completion_ids == b.completion_ids
    assert a.finish_reasons == b.finish_reasons
    for x, y in zip(a.logprobs, b.logprobs):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


@pytest.mark.slow
def test_static_cache_greedy_ids_and_logprobs_equal_the_dynamic_cache(setup):
    sampling = SamplingParams(n=1, max_new_tokens=10, temperature=0.0)
    _assert_same(_run(setup, sampling, static_cache=True), _run(setup, sampling, static_cache=False))


@pytest.mark.slow
def test_static_cache_sampling_with_rows_stopping_early_equals_the_dynamic_cache(setup):
    # Many stop ids so that some rows stop early (the static cache then drops their rows) and others run to length.
    sampling = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, stop_token_ids=list(range(40, 140)))
    static = _run(setup, sampling, static_cache=True)
    _assert_same(static, _run(setup, sampling, static_cache=False))
    assert {FINISH_STOP, FINISH_LENGTH} <= set(static.finish_reasons)
    assert len({len(ids) for ids in static.completion_ids}) > 2


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
                                     dict(temperature=1.3, repetition_penalty=1.2), dict(temperature=0.0)])
def test_per_step_processors_give_exactly_the_scores_of_transformers_processor_list(options):
    # The decode loop calls its processors directly with a precomputed suppression mask; the scores
    # (hence the sampled ids and the recorded logprobs) must be bit-identical to transformers' list.
    from vlrft.decoding import sampling_processors, step_processors

    vocab, suppressed = 300, (5, 17, 299, 1000)  # an id past the vocabulary is ignored, as transformers does
    sampling = SamplingParams(n=2, max_new_tokens=4, **options)
    generator = torch.Generator().manual_seed(0)
    history = torch.randint(0, vocab, (6, 9), generator=generator)
    scores = torch.randn(6, vocab, generator=generator) * 3
    expected = sampling_processors(sampling, suppressed, "cpu")(history, scores.clone())
    got = scores.clone()
    for processor in step_processors(sampling, suppressed, vocab, "cpu"):
        got = processor(history, got)
    assert torch.equal(got, expected)
    assert torch.isinf(got[:, [5, 17, 299]]).all()


@pytest.mark.slow
def test_decode_mask_is_prebuilt_for_sdpa_and_left_to_the_model_for_eager_attention(setup, tiny_vlm_dir):
    # SDPA takes the ready boolean 4D mask; eager attention needs its own additive mask, so it gets
    # the 2D padding mask. Both must decode what transformers' generate decodes, padding included.
    from vlrft.models.actor import split_head
    from vlrft.decoding.transformers_layers import step_mask_buffer

    processor, sdpa_model, tokens, batch = setup
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert step_mask_buffer(split_head(sdpa_model)[0], prompt_mask, 5).shape == (2, 1, 1, 5)
    eager_model = load_policy(tiny_vlm_dir("qwen2_5_vl"), attn_implementation="eager").eval()
    assert step_mask_buffer(split_head(eager_model)[0], prompt_mask, 5).tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
    for static in (False, True):
        ours = HFEngine(lambda: eager_model, processor, tokens, share_prompts=True, static_cache=static,
                        lean_decode=False).generate(batch, sampling)
        theirs = HFEngine(lambda: eager_model, processor, tokens, share_prompts=False).generate(batch, sampling)
        assert ours.completion_ids == theirs.completion_ids
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)

"""The transformers rollout engine: groups, finish reasons, logprobs that match the trainer's, stop handling."""

import pytest
import torch

from _rollout_helpers import engine_setup, solid_png
from vlrft.data import Sample
from vlrft.models.actor import ActorVL
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, Rollouts, SamplingParams, cut_at_stop
from vlrft.rollout.hf import HFEngine
from vlrft.batch import build_sequences


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl_moe", "glm4v", "gemma3",
                                        *(pytest.param(a, marks=pytest.mark.slow)
                                          for a in ("internvl", "llava_onevision", "smolvlm"))])
def setup(request, tiny_vlm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    red, blue = solid_png(root, "red", (220, 30, 30)), solid_png(root, "blue", (30, 70, 220))
    samples = [
        Sample(id="a", prompt="<image>What color is the shape?", images=[red], answer="red"),
        Sample(id="b", prompt="Say something.", answer="x"),
        Sample(id="c", prompt="<image><image>Which is blue?", images=[red, blue], answer="second"),
    ]
    return engine_setup(tiny_vlm_dir(request.param), samples)


def assert_logprobs_match_the_trainer(model, tokens, batch, out: Rollouts) -> None:
    """Each rollout's engine logprobs equal the trainer's (ActorVL on the same model and sequences) within 1e-4."""
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    seqs = build_sequences(batch.prompt_ids, batch.visual, out.completion_ids, out.prompt_index, tokens.pad_id)
    with torch.no_grad():
        trainer_lp = actor.logprobs(seqs).logprobs
    for r, lp in enumerate(out.logprobs):
        assert torch.allclose(trainer_lp[r, :len(lp)], torch.tensor(lp), atol=1e-4), r


def test_cut_at_stop_keeps_the_stop_token_and_names_the_reason():
    assert cut_at_stop([5, 6, 2, 0, 0], {2, 0}, 5) == ([5, 6, 2], FINISH_STOP)
    assert cut_at_stop([5, 6, 7], {2}, 3) == ([5, 6, 7], FINISH_LENGTH)
    # a trailing token that happens to equal EOS at max length is still a stop, not a truncation
    assert cut_at_stop([5, 6, 2], {2}, 3) == ([5, 6, 2], FINISH_STOP)


@pytest.mark.parametrize("share", [True, False], ids=["group-decoder", "transformers-generate"])
def test_groups_are_contiguous_and_logprobs_match_the_trainer(setup, share):
    processor, model, tokens, batch = setup
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=share)
    torch.manual_seed(0)
    out = engine.generate(batch, SamplingParams(n=3, max_new_tokens=6, temperature=1.0))
    assert isinstance(out, Rollouts) and len(out) == 9 and out.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(len(lp) == len(ids) for lp, ids in zip(out.logprobs, out.completion_ids))
    for ids, reason in zip(out.completion_ids, out.finish_reasons):
        stops = [i for i, t in enumerate(ids) if t in tokens.eos_ids]
        assert (reason == FINISH_STOP) == bool(stops)
        if stops:  # cut right after the first stop token
            assert stops == [len(ids) - 1]
        else:
            assert len(ids) == 6
        assert not set(ids) & set(tokens.suppressed_ids)  # never a vision placeholder
    assert out.texts == processor.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    assert_logprobs_match_the_trainer(model, tokens, batch, out)


def test_greedy_is_deterministic_and_identical_across_the_group(setup):
    processor, model, tokens, batch = setup
    engine = HFEngine(lambda: model, processor, tokens)
    a = engine.generate(batch, SamplingParams(n=2, max_new_tokens=5, temperature=0.0))
    b = engine.generate(batch, SamplingParams(n=2, max_new_tokens=5, temperature=0.0))
    assert a.completion_ids == b.completion_ids
    assert a.completion_ids[0] == a.completion_ids[1] and a.completion_ids[4] == a.completion_ids[5]


@pytest.mark.slow
def test_batched_generation_equals_one_prompt_at_a_time(setup):
    processor, model, tokens, batch = setup
    sampling = SamplingParams(n=1, max_new_tokens=5, temperature=0.0)
    together = HFEngine(lambda: model, processor, tokens, max_batch_prompts=8).generate(batch, sampling)
    alone = HFEngine(lambda: model, processor, tokens, max_batch_prompts=1).generate(batch, sampling)
    assert together.completion_ids == alone.completion_ids


def test_group_decoder_and_transformers_generate_agree(setup):
    processor, model, tokens, batch = setup
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.0, repetition_penalty=1.3)
    ours = HFEngine(lambda: model, processor, tokens, share_prompts=True).generate(batch, sampling)
    theirs = HFEngine(lambda: model, processor, tokens, share_prompts=False).generate(batch, sampling)
    assert ours.completion_ids == theirs.completion_ids and ours.finish_reasons == theirs.finish_reasons
    for a, b in zip(ours.logprobs, theirs.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)  # different batch shapes, same math


@pytest.mark.parametrize("share", [True, False], ids=["group-decoder", "transformers-generate"])
def test_stop_string_cuts_right_after_it(setup, share):
    processor, model, tokens, batch = setup
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=share)
    torch.manual_seed(1)
    free = engine.generate(batch, SamplingParams(n=1, max_new_tokens=8, temperature=0.0))
    text = free.texts[0]
    assert len(text) > 3
    # a string the greedy completion is known to contain, whole characters (a random model's tokens can be parts of
    # one UTF-8 character, which decode alone as U+FFFD and so never end a decoded stop string); one character where
    # no two whole ones follow each other (the tiny SmolVLM's greedy text is '1\ufffdp\ufffd1\ufffdp\ufffd')
    stop = next((text[i:i + n] for n in (2, 1) for i in range(1, len(text) - n + 1) if "\ufffd" not in text[i:i + n]))
    cut = engine.generate(batch, SamplingParams(n=1, max_new_tokens=8, temperature=0.0, stop=(stop,)))
    ids = cut.completion_ids[0]
    assert cut.finish_reasons[0] == FINISH_STOP
    # cut at the first token that completes the stop string: with it the text has the string, without it not
    assert stop in processor.tokenizer.decode(ids) and stop not in processor.tokenizer.decode(ids[:-1])
    assert free.completion_ids[0][:len(cut.completion_ids[0])] == cut.completion_ids[0]


def test_engine_restores_training_mode(setup):
    processor, model, tokens, batch = setup
    model.train()
    HFEngine(lambda: model, processor, tokens).generate(batch.select([1]), SamplingParams(n=1, max_new_tokens=2))
    assert model.training
    model.eval()


@pytest.mark.parametrize("share", [True, False], ids=["group-decoder", "transformers-generate"])
def test_min_new_tokens_holds_back_the_stop_tokens(setup, share):
    processor, model, tokens, batch = setup
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=share)
    # make the end-of-turn token by far the likeliest, so only min_new_tokens can hold it back
    bias = torch.zeros(model.lm_head.weight.shape[0])
    bias[list(tokens.eos_ids)] = 50.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    try:
        free = engine.generate(batch, SamplingParams(n=2, max_new_tokens=6, temperature=1.0))
        held = engine.generate(batch, SamplingParams(n=2, max_new_tokens=6, min_new_tokens=4, temperature=1.0))
    finally:
        model.lm_head.bias = None
    assert all(len(ids) == 1 for ids in free.completion_ids)  # stops at once
    assert all(len(ids) == 5 and ids[-1] in tokens.eos_ids for ids in held.completion_ids)
    assert all(not set(ids[:4]) & set(tokens.eos_ids) for ids in held.completion_ids)


@pytest.mark.slow
def test_llava_onevision_samples_after_a_video_with_the_trainers_logprobs(tiny_vlm_dir, tmp_path):
    """LLaVA-OneVision with a video prompt (data.video_max_frames frames, 32 by default: the 3 frames given are spread
    over them) beside a text one: the hf engine samples through the group decoder (1-D positions), never a vision token, with
    logprobs equal to the trainer's (prompt shared)."""
    from _data_helpers import noise_image, write_png

    pytest.importorskip("torchvision")
    frames = [str(write_png(tmp_path / f"f{i}.png", noise_image(40, 60, seed=i))) for i in range(3)]
    samples = [Sample(id="v", prompt="<video>What happens?", videos=[frames], answer="x"),
               Sample(id="t", prompt="Say something.", answer="x")]
    processor, model, tokens, batch = engine_setup(tiny_vlm_dir("llava_onevision"), samples)
    assert tuple(batch.visual.pixel_values_videos.shape[:2]) == (1, 32)
    torch.manual_seed(0)
    out = HFEngine(lambda: model, processor, tokens).generate(batch, SamplingParams(n=2, max_new_tokens=5))
    assert len(out) == 4 and not any(set(ids) & set(tokens.suppressed_ids) for ids in out.completion_ids)
    assert_logprobs_match_the_trainer(model, tokens, batch, out)

"""The embedded HF engine samples from the distribution the config names, not the checkpoint's defaults."""

from __future__ import annotations

import pytest
import torch
from PIL import Image


@pytest.mark.parametrize("share", [True, False], ids=["group-decoder", "transformers-generate"])
def test_top_k_off_is_not_overridden_by_the_checkpoint_generation_config(tiny_vlm_dir, share):
    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder
    from vlrft.data.sample import Sample
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.rollout.base import SamplingParams
    from vlrft.rollout.hf import HFEngine
    from vlrft.tokens import TokenSpec

    folder = tiny_vlm_dir()
    processor, model = load_processor(folder), load_policy(folder)
    model.generation_config.top_k = 1  # what a checkpoint's generation_config.json may carry
    model.generation_config.min_p = 1.0
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    sample = Sample(id="red", prompt="<image>What color is the shape?", images=[Image.new("RGB", (56, 56), (200, 30, 30))])
    batch = PromptEncoder(processor, DataConfig()).encode([sample]).batch
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=share)

    torch.manual_seed(0)
    rollouts = engine.generate(batch, SamplingParams(n=6, max_new_tokens=6, temperature=1.0, top_k=0))

    # With the checkpoint's top_k=1 or min_p=1 leaking in, all six completions would be the same greedy one.
    assert len({tuple(ids) for ids in rollouts.completion_ids}) > 1


def _engine_and_batch(tiny_vlm_dir):
    from vlrft.config import DataConfig
    from vlrft.data import PromptEncoder
    from vlrft.data.sample import Sample
    from vlrft.models.loading import load_policy, load_processor
    from vlrft.tokens import TokenSpec

    folder = tiny_vlm_dir()
    processor, model = load_processor(folder), load_policy(folder).eval()
    tokens = TokenSpec.from_model(processor, model.config, model.generation_config)
    samples = [Sample(id="red", prompt="<image>What color is the shape?",
                      images=[Image.new("RGB", (56, 56), (200, 30, 30))]),
               Sample(id="text", prompt="Say something.")]
    batch = PromptEncoder(processor, DataConfig()).encode(samples).batch
    return processor, model, tokens, batch


@pytest.mark.parametrize("share", [True, False], ids=["group-decoder", "transformers-generate"])
def test_recorded_logprobs_are_of_the_tempered_distribution_actually_sampled(tiny_vlm_dir, share):
    """The TIS weights compare the trainer's logprobs at the rollout temperature with these: they must agree."""
    from vlrft.models.actor import ActorVL
    from vlrft.rollout.base import SamplingParams
    from vlrft.rollout.hf import HFEngine
    from vlrft.batch import build_sequences

    processor, model, tokens, batch = _engine_and_batch(tiny_vlm_dir)
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=share)
    torch.manual_seed(0)
    out = engine.generate(batch, SamplingParams(n=3, max_new_tokens=6, temperature=0.7, top_k=0))
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    seqs = build_sequences(batch.prompt_ids, batch.visual, out.completion_ids, out.prompt_index, tokens.pad_id)
    with torch.no_grad():
        expected = actor.logprobs(seqs, temperature=0.7).logprobs
    for row, lp in enumerate(out.logprobs):
        assert torch.allclose(expected[row, :len(lp)], torch.tensor(lp), atol=1e-4), row


@pytest.mark.parametrize("share", [True, False], ids=["group-decoder", "transformers-generate"])
def test_recorded_logprobs_come_after_top_k(tiny_vlm_dir, share):
    """With top_k=1 only one token survives the warpers: it was sampled with probability 1 (logprob 0)."""
    from vlrft.rollout.base import SamplingParams
    from vlrft.rollout.hf import HFEngine

    processor, model, tokens, batch = _engine_and_batch(tiny_vlm_dir)
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=share)
    out = engine.generate(batch, SamplingParams(n=2, max_new_tokens=5, temperature=1.0, top_k=1))
    values = torch.tensor([v for row in out.logprobs for v in row])
    assert values.numel() > 0 and torch.allclose(values, torch.zeros_like(values), atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_every_vision_special_token_is_suppressed_including_vision_pad(tiny_vlm_dir, arch):
    """A completion holding a vision placeholder breaks the trainer's forward ("image tokens != features")."""
    from vlrft.models.loading import load_processor
    from vlrft.tokens import TokenSpec
    from transformers import AutoConfig

    folder = tiny_vlm_dir(arch)
    processor, config = load_processor(folder), AutoConfig.from_pretrained(folder)
    tokens = TokenSpec.from_model(processor, config)
    vocab = processor.tokenizer.get_vocab()
    names = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
    assert set(tokens.suppressed_ids) == {vocab[name] for name in names}
    assert not {vocab["<|im_end|>"], vocab["<|endoftext|>"]} & set(tokens.suppressed_ids)


def test_sample_tokens_draws_each_row_from_its_own_distribution_never_a_zero_probability_token():
    from vlrft.decoding import sample_tokens

    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0],  # zeros at both ends and between
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]])
    draws = torch.stack([sample_tokens(probs) for _ in range(20000)])  # [draws, rows]
    assert (draws[:, 1] == 5).all() and (draws[:, 2] == 0).all()
    for row in (0, 3):
        frequencies = torch.bincount(draws[:, row], minlength=6) / len(draws)
        assert torch.allclose(frequencies, probs[row], atol=0.015), (row, frequencies)
    assert draws.min() >= 0 and draws.max() <= 5


@pytest.mark.parametrize("sampling", [dict(top_p=0.6), dict(top_k=5, top_p=0.9), dict(min_p=0.8)],
                         ids=["top_p", "top_k+top_p", "min_p"])
def test_on_policy_tis_weights_are_one_under_top_p_top_k_and_min_p(tiny_vlm_dir, sampling):
    """The engine's logprob is the truncated distribution's, log p(a) - log(kept mass); the trainer's is the full
    one's. With the kept mass (`ActorVL.sampling_truncation`) the on-policy TIS weight is 1; without it, below 1."""
    from vlrft.batch import build_sequences
    from vlrft.models.actor import ActorVL
    from vlrft.models.logprobs import SamplingTruncation
    from vlrft.rollout.base import SamplingParams
    from vlrft.rollout.hf import HFEngine

    processor, model, tokens, batch = _engine_and_batch(tiny_vlm_dir)
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=True)
    torch.manual_seed(0)
    out = engine.generate(batch, SamplingParams(n=4, max_new_tokens=8, temperature=0.8, **sampling))
    actor = ActorVL(model, tokens.image_token_id, tokens.video_token_id, suppressed_ids=tokens.suppressed_ids)
    actor.sampling_truncation = SamplingTruncation(**sampling)
    seqs = build_sequences(batch.prompt_ids, batch.visual, out.completion_ids, out.prompt_index, tokens.pad_id)
    with torch.no_grad():
        result = actor.logprobs(seqs, temperature=0.8)
    mask = seqs.completion_mask.bool()
    engine_lp = torch.zeros_like(result.logprobs)
    for row, lp in enumerate(out.logprobs):
        engine_lp[row, :len(lp)] = torch.tensor(lp)
    log_w = (result.logprobs - (engine_lp + result.kept_log_mass))[mask]
    assert log_w.abs().max() < 1e-4  # weight 1 within 1e-4
    assert (result.logprobs - engine_lp)[mask].mean() < -0.01  # the full distribution's logprob alone: below 1
    assert (result.kept_log_mass[mask] <= 1e-6).all()

"""The group decoder on the 1-D-position families (Gemma 3, InternVL 3, LLaVA-OneVision, SmolVLM): each prompt
prefilled once, its group continuing it at the prompt's last position + 1, + 2, ... Checked against references
computed without vlrft's decoder: transformers' `generate` on each prompt alone (greedy, token for token), and a
plain float64 forward of each prompt + completion (sampled logprobs within 1e-5)."""

import copy

import pytest
import torch

from _rollout_helpers import engine_setup, solid_png
import vlrft.sampling as sampling_module
from vlrft.data import Sample
from vlrft.decoding import decode_groups, groups, prefill
from vlrft.decoding.lean_weights import unsupported_reason
from vlrft.decoding.transformers_layers import text_model_of
from vlrft.models.actor import split_head
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from vlrft.rollout.hf import HFEngine
from vlrft.vision import mm_token_type_ids, token_type_kwargs

FAMILIES = ["gemma3", "internvl", "llava_onevision", "smolvlm"]
# the variant table.choose picks on a CPU: the lean step for Qwen2 (InternVL, LLaVA-OV) and Llama (SmolVLM) text
# decoders; transformers' layers for Gemma 3 (sliding-window layers)
EXPECTED_VARIANT = {"gemma3": "transformers_dynamic", "internvl": "lean", "llava_onevision": "lean",
                    "smolvlm": "lean"}


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tiny_vlm_dir, tmp_path_factory):
    """An image prompt and two text prompts of different lengths (one batch, left-padded)."""
    red = solid_png(tmp_path_factory.mktemp("imgs"), "red", (220, 30, 30))
    samples = [Sample(id="a", prompt="<image>What color is the shape?", images=[red]),
               Sample(id="b", prompt="Say something rather longer than the others, please, and then some more."),
               Sample(id="c", prompt="Hi")]
    return (request.param, *engine_setup(tiny_vlm_dir(request.param), samples))


@pytest.fixture
def variants(monkeypatch):
    """The decoder variants decode calls chose (so a test cannot pass on transformers' `generate`)."""
    chosen = []
    choose = groups.choose

    def recorded(**kwargs):
        chosen.append(choose(**kwargs))
        return chosen[-1]

    monkeypatch.setattr(groups, "choose", recorded)
    return chosen


def _generate_alone(model, tokens, batch, prompt: int, max_new: int, stop_ids: set[int]) -> list[int]:
    """transformers' greedy `generate` on prompt `prompt` alone (no padding): its completion ids."""
    from transformers import GenerationConfig

    ids = torch.tensor([batch.prompt_ids[prompt]])
    types = mm_token_type_ids(ids, tokens.image_token_id, tokens.video_token_id)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=sorted(stop_ids),
                              pad_token_id=tokens.pad_id, suppress_tokens=list(tokens.suppressed_ids) or None)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **token_type_kwargs(model, types),
                         **batch.visual.select([prompt]).model_inputs(), generation_config=config)
    return out[0, ids.shape[1]:].tolist()


def _decode(model, tokens, batch, sampling, stop_ids, cuda_graph=False):
    return decode_groups(model, batch.prompt_ids, batch.visual, sampling, pad_id=tokens.pad_id, stop_ids=stop_ids,
                         image_token_id=tokens.image_token_id, video_token_id=tokens.video_token_id,
                         suppressed_ids=tokens.suppressed_ids, cuda_graph=cuda_graph)


def _stops_some_rows_early(model, tokens, batch, max_new: int) -> set[int]:
    """EOS and one token that prompt 0's greedy completion reaches early and prompt 1's never does."""
    stop = set(tokens.eos_ids)
    first, second = (_generate_alone(model, tokens, batch, p, max_new, stop) for p in (0, 1))
    early = next(t for t in first[1:6] if t not in second and t not in stop)
    return stop | {early}


def test_the_lean_step_takes_the_qwen2_and_llama_decoders_and_refuses_gemma3s_sliding_windows(setup):
    family, _, model, _, _ = setup
    reason = unsupported_reason(text_model_of(split_head(model)[0]))
    if family == "gemma3":
        assert reason is not None and ("sliding" in reason or "Gemma3" in reason)
    else:
        assert reason is None


@pytest.mark.parametrize("cuda_graph", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["lean", "fixed_shapes"])
def test_greedy_groups_equal_generate_on_each_prompt_alone(setup, variants, cuda_graph):
    """Groups of 2, prompts of three lengths (an image prompt among them), one row stopping at a stop token: every
    row's ids equal transformers' greedy `generate` on its prompt alone, token for token."""
    family, _, model, tokens, batch = setup
    if cuda_graph and EXPECTED_VARIANT[family] != "lean":
        pytest.skip("the fixed-shape steps are the lean step's")
    max_new = 10
    stop = _stops_some_rows_early(model, tokens, batch, max_new)
    out = _decode(model, tokens, batch, SamplingParams(n=2, max_new_tokens=max_new, temperature=0.0), stop,
                  cuda_graph=cuda_graph)
    assert variants == ["fixed_rows" if cuda_graph else EXPECTED_VARIANT[family]]
    expected = [_generate_alone(model, tokens, batch, p, max_new, stop) for p in range(len(batch.prompt_ids))]
    assert out.ids == [ids for ids in expected for _ in range(2)]
    assert FINISH_STOP in out.reasons and FINISH_LENGTH in out.reasons


def _float64_logprobs(model, tokens, batch, prompt: int, completion: list[int]) -> torch.Tensor:
    """log p(completion token) under a plain float64 forward of prompt + completion (the suppressed tokens masked,
    as sampling masks them)."""
    ids = torch.tensor([batch.prompt_ids[prompt] + completion])
    types = mm_token_type_ids(ids, tokens.image_token_id, tokens.video_token_id)
    visual = {k: v.double() if torch.is_floating_point(v) else v
              for k, v in batch.visual.select([prompt]).model_inputs().items()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **token_type_kwargs(model, types),
                       **visual).logits[0].double()
    start = len(batch.prompt_ids[prompt]) - 1
    scores = logits[start:start + len(completion)]
    scores[:, list(tokens.suppressed_ids)] = float("-inf")
    return scores.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_sampled_logprobs_equal_a_float64_forward(setup, variants, monkeypatch):
    """Groups of 3 sampled (seeded), each prompt's KV held once for its group (the lean families), rows stopping
    early: each token's logprob equals a float64 forward of the row's prompt + completion within 1e-5."""
    family, processor, model, tokens, batch = setup
    monkeypatch.setattr(sampling_module, "SHARED_PROMPT_TOKENS", 0)  # share even these short prompts
    sampling = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, stop_token_ids=tuple(range(40, 90)))
    engine = HFEngine(lambda: model, processor, tokens, share_prompts=True)
    torch.manual_seed(0)
    out = engine.generate(batch, sampling)
    torch.manual_seed(0)
    assert engine.generate(batch, sampling).completion_ids == out.completion_ids  # seeded: reproducible
    assert variants == [EXPECTED_VARIANT[family]] * 2
    assert FINISH_STOP in out.finish_reasons and FINISH_LENGTH in out.finish_reasons
    reference = copy.deepcopy(model).double()
    for row, (ids, logprobs) in enumerate(zip(out.completion_ids, out.logprobs)):
        expected = _float64_logprobs(reference, tokens, batch, out.prompt_index[row], ids)
        assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), expected, atol=1e-5), row


def test_prompts_prefilled_in_groups_decode_as_one_prefill(setup, monkeypatch):
    """Under a prefill token budget the prompts prefill in groups whose caches are merged (Gemma 3's sliding-window
    layers: each group keeps its last window positions, right-aligned): the same greedy ids as `generate`."""
    family, _, model, tokens, batch = setup
    backbone, _ = split_head(model)
    lengths = sorted(len(ids) for ids in batch.prompt_ids)
    if family == "gemma3":
        assert lengths[-1] > model.config.text_config.sliding_window  # the sliding layers' caches are cut
    calls = []
    forward = type(backbone).forward

    def counted(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(prefill, "PREFILL_TOKENS", lengths[-1])  # one prompt a call
    monkeypatch.setattr(type(backbone), "forward", counted)
    max_new = 8
    stop = set(tokens.eos_ids)
    out = _decode(model, tokens, batch, SamplingParams(n=2, max_new_tokens=max_new, temperature=0.0), stop)
    assert sorted(n for n in calls if n > 1) == lengths  # one prefill call per prompt, unpadded
    expected = [_generate_alone(model, tokens, batch, p, max_new, stop) for p in range(len(batch.prompt_ids))]
    assert out.ids == [ids for ids in expected for _ in range(2)]

"""The vLLM / SGLang engines' pure parts, on CPU with real tiny models and processors: sampling-option
mapping, requests built from our prompt ids (one tokenization), output parsing into Rollouts, weight
naming / LoRA merging / bucketing, the sleep-wake-sync bookkeeping and the config checks.

Objects named `Fake*` are stand-ins shaped like vLLM's `RequestOutput` / `CompletionOutput` / `Logprob`
(documented fields only) and `RecordingBackend` records what a colocated engine asks of its backend;
none of them runs a model. The real engines are exercised in tests/test_rollout_engines_gpu.py.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from _stand_ins import RecordingBackend
from vlrft.config import Config, DataConfig, ToolConfig
from vlrft.families import FAMILIES
from vlrft.data import PromptEncoder, Sample
from vlrft.errors import ConfigError, MissingDependencyError
from vlrft.rollout.base import SamplingParams
from vlrft.rollout.colocate import ColocatedEngine, EngineOptions, GroupComm, Memory, RankLayout
from vlrft.tokens import TokenSpec
from vlrft.rollout.outputs import (EngineError, EngineSample, PromptMismatchError, sglang_samples, to_rollouts,
                                   vllm_samples)
from vlrft.rollout.requests import (EngineInputError, PromptRequest, ProcessorOutput, expand_vision_placeholders,
                                    fold_vision_placeholders, image_wrappers, placeholder_runs, sglang_requests,
                                    tokens_per_item, unwrap_image_runs, ImageText, fold_tiled_images,
                                    vllm_requests)
from vlrft.rollout.sglang import sglang_engine_kwargs, sglang_sampling_params
from vlrft.rollout.vllm import vllm_engine_kwargs, vllm_sampling_kwargs
from vlrft.models.weights import PolicyWeights, on_mesh_device

ARCHES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
DATA = DataConfig(max_prompt_length=512, video_fps=2.0)


def noise(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def tokens_of(processor, model_dir) -> TokenSpec:
    from transformers import AutoConfig

    return TokenSpec.from_model(processor, AutoConfig.from_pretrained(model_dir))


@pytest.fixture
def encoded(tiny_processor, tiny_vlm_dir):
    """`encoded(arch, with_video=False)` -> (batch, tokens, processor): text-only, 1-image and 3-image prompts."""

    def make(arch: str, with_video: bool = False):
        processor = tiny_processor(arch)
        samples = [
            Sample("text", "Describe a red circle."),
            Sample("one", "<image>What color is the shape?", images=[noise(64, 64, 1)]),
            Sample("three", "Compare <image> with <image> and <image>.",
                   images=[noise(64, 64, 2), noise(128, 64, 3), noise(64, 128, 4)]),
        ]
        if with_video:
            samples.append(Sample("video", "<video>What happens?", videos=[[noise(64, 64, 10 + i) for i in range(4)]]))
        batch = PromptEncoder(processor, DATA).encode(samples).batch
        return batch, tokens_of(processor, tiny_vlm_dir(arch)), processor

    return make


# ---------------------------------------------------------------------------------------------- sampling options

TOKENS = TokenSpec(pad_id=0, eos_ids=(2, 9), image_token_id=6, video_token_id=7, suppressed_ids=(6, 7, 3))
SAMPLED = SamplingParams(n=4, max_new_tokens=33, min_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                         repetition_penalty=1.1, stop=("</answer>",), stop_token_ids=(9, 11))


def test_vllm_sampling_options_map_every_field():
    kwargs = vllm_sampling_kwargs(SAMPLED, TOKENS)
    assert kwargs == dict(n=4, max_tokens=33, min_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                          stop=["</answer>"], stop_token_ids=[2, 9, 11], ignore_eos=False, logprobs=0,
                          detokenize=True, skip_special_tokens=True,
                          logit_bias={6: -math.inf, 7: -math.inf, 3: -math.inf})


def test_vllm_greedy_and_disabled_options():
    kwargs = vllm_sampling_kwargs(SamplingParams(n=2, temperature=0.0, top_p=0.5, top_k=5, min_p=0.2), TOKENS,
                                  logprobs=False)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"], kwargs["min_p"]) == (0.0, 1.0, 0, 0.0)
    assert kwargs["logprobs"] is None and kwargs["stop"] is None
    assert kwargs["detokenize"] is False  # no stop strings: we decode the ids ourselves
    assert vllm_sampling_kwargs(SamplingParams(top_k=0), TOKENS)["top_k"] == 0  # 0 = off in both
    no_suppression = TokenSpec(pad_id=0, eos_ids=(2,), image_token_id=6, video_token_id=7)
    assert "logit_bias" not in vllm_sampling_kwargs(SamplingParams(), no_suppression)


def test_sglang_sampling_options_map_every_field():
    params = sglang_sampling_params(SAMPLED, TOKENS)
    assert params == dict(n=4, max_new_tokens=33, min_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                          repetition_penalty=1.1, stop=["</answer>"], stop_token_ids=[2, 9, 11], ignore_eos=False,
                          skip_special_tokens=True, logit_bias={"6": -math.inf, "7": -math.inf, "3": -math.inf})
    greedy = sglang_sampling_params(SamplingParams(temperature=0.0, top_k=5), TOKENS)
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, -1, 1.0)
    assert sglang_sampling_params(SamplingParams(top_k=0), TOKENS)["top_k"] == -1  # SGLang's "off"


def test_vllm_engine_kwargs_follow_the_config():
    cfg = Config()
    cfg.model.path, cfg.model.dtype = "/models/qwen", "bfloat16"
    cfg.rollout.max_new_tokens, cfg.data.max_prompt_length = 256, 1024
    cfg.rollout.tensor_parallel_size, cfg.rollout.gpu_memory_utilization = 2, 0.4
    cfg.rollout.engine_kwargs = {"enforce_eager": True, "seed": 7}
    kwargs = vllm_engine_kwargs(cfg, RankLayout(rank=3, world_size=4, tp_size=2), distributed=True,
                                supported={"logprobs_mode"})
    assert kwargs["model"] == "/models/qwen" and kwargs["dtype"] == "bfloat16"
    assert kwargs["max_model_len"] == 1280  # prompt budget + completion budget
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["gpu_memory_utilization"] == 0.4
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["enforce_eager"] is True and kwargs["seed"] == 7  # engine_kwargs win
    older = vllm_engine_kwargs(cfg, RankLayout(0, 1, 1), distributed=False, supported=set())
    assert "logprobs_mode" not in older and "distributed_executor_backend" not in older


def test_with_tools_the_engines_take_a_whole_trajectory_after_the_prompt():
    """A later turn's request is the prompt plus the trajectory so far (up to rollout.max_trajectory_tokens) and asks
    for one more turn (rollout.max_new_tokens): a context of prompt + max_new_tokens would refuse it mid-run."""
    cfg = Config()
    cfg.rollout.max_new_tokens, cfg.data.max_prompt_length = 512, 1024
    cfg.rollout.tools, cfg.rollout.max_trajectory_tokens = [ToolConfig(name="zoom")], 3000
    layout = RankLayout(0, 1, 1)
    assert vllm_engine_kwargs(cfg, layout, distributed=False, supported=set())["max_model_len"] == 1024 + 3000 + 512
    assert sglang_engine_kwargs(cfg, layout, gpu_id=0)["context_length"] == 1024 + 3000 + 512 + 1  # SGLang: >=
    cfg.rollout.max_model_len = 5000  # an explicit length wins
    assert vllm_engine_kwargs(cfg, layout, distributed=False, supported=set())["max_model_len"] == 5000
    assert sglang_engine_kwargs(cfg, layout, gpu_id=0)["context_length"] == 5000


def test_sglang_engines_of_a_node_get_ports_of_their_own_below_the_ephemeral_range():
    """Left to SGLang, each engine draws its tensor-parallel store port at random (22000-29999): 8 engines on a
    node then collide about once in 300 starts. Every engine of a node gets its own server and store port, on a
    job of any size (64 nodes of 8 GPUs here) below Linux's ephemeral ports (32768 up: a connection could take
    ours), which a port per engine of the whole job passed from 277 engines on."""
    cfg = Config()
    for tp in (1, 2, 8):
        by_node: dict[int, list[int]] = {}
        for leader in range(0, 512, tp):
            kwargs = sglang_engine_kwargs(cfg, RankLayout(leader, 512, tp), gpu_id=leader % 8)
            by_node.setdefault(leader // 8, []).extend([kwargs["port"], kwargs["nccl_port"]])
        for ports in by_node.values():
            assert len(set(ports)) == len(ports) == 2 * 8 // tp
            assert max(ports) < 32768


# ---------------------------------------------------------------------------------------------- requests


def test_placeholder_runs_and_fold_expand_roundtrip():
    ids = [1, 3, 6, 6, 6, 4, 5, 3, 6, 6, 4, 3, 7, 7, 4, 2]
    assert placeholder_runs(ids, 6) == [3, 2] and placeholder_runs(ids, 7) == [2]
    folded = fold_vision_placeholders(ids, 6, 7, [3, 2], [2], "s")
    assert folded == [1, 3, 6, 4, 5, 3, 6, 4, 3, 7, 4, 2]
    assert expand_vision_placeholders(folded, 6, 7, [3, 2], [2]) == ids


def test_fold_refuses_runs_that_do_not_match_the_grids():
    with pytest.raises(EngineInputError, match=r"s1: the prompt's image placeholder runs are \[3\] tokens long but "
                                               r"its images need \[4\]"):
        fold_vision_placeholders([3, 6, 6, 6, 4], 6, 7, [4], [], "s1")
    with pytest.raises(EngineInputError, match="frame groups with timestamp text.*rollout.engine=sglang"):
        fold_vision_placeholders([3, 7, 7, 4, 9, 3, 7, 7, 4], 6, 7, [], [4], "s2")


def test_fold_without_grids_takes_one_run_of_any_length_per_item():
    """LLaVA-OneVision has no grids: an image's placeholder count follows from its crops and size, so the fold asks
    for one run per image and leaves the lengths to the exact-ids check after vLLM's expansion."""
    ids = [1, 6, 6, 6, 6, 6, 4, 6, 6, 3, 7, 7, 7, 2]
    assert fold_vision_placeholders(ids, 6, 7, 2, 1, "s") == [1, 6, 4, 6, 3, 7, 2]
    with pytest.raises(EngineInputError, match=r"^s: the prompt has 2 image placeholder runs \(\[5, 2\] tokens long\) "
                                               r"but 3 images, each of which must be one run$"):
        fold_vision_placeholders(ids, 6, 7, 3, 1, "s")
    with pytest.raises(EngineInputError, match=r"^s: the prompt has 1 video placeholder runs"):
        fold_vision_placeholders(ids, 6, 7, 2, 0, "s")


def test_vllm_requests_of_llava_onevision_fold_images_alone_and_refuse_images_encoded_together(encoded):
    """An image alone in its prompt (base crop + anyres grid) is what vLLM's processor computes from the PIL image;
    each image of a multi-image prompt is one crop, which vLLM's processor (every image as if alone) does not do."""
    batch, tokens, _ = encoded("llava_onevision")
    requests = vllm_requests(batch.select([0, 1]), tokens)
    assert requests[0].payload == {"prompt_token_ids": batch.prompt_ids[0]}
    folded = requests[1].payload["prompt_token_ids"]
    assert folded.count(tokens.image_token_id) == 1 and batch.prompt_ids[1].count(tokens.image_token_id) > 1
    assert expand_vision_placeholders(folded, tokens.image_token_id, tokens.video_token_id,
                                      placeholder_runs(batch.prompt_ids[1], tokens.image_token_id), []) == \
        batch.prompt_ids[1]
    assert requests[1].payload["multi_modal_data"]["image"][0] is batch.images[1][0]
    with pytest.raises(EngineInputError, match=r"^<memory> \(id 'three'\): LLaVA-OneVision encodes each image of a "
                                               r"multi-image prompt as one crop.*use rollout.engine=hf") as caught:
        vllm_requests(batch, tokens)
    assert "\n" not in str(caught.value)


def test_unwrap_drops_the_start_and_end_tokens_around_each_run_and_refuses_any_other_layout():
    """InternVL 3: `<img>` (8) + `<IMG_CONTEXT>` (6) x N + `</img>` (9) per image; vLLM writes the 8 and 9 itself."""
    ids = [1, 8, 6, 6, 6, 9, 4, 8, 6, 6, 9, 2]
    assert unwrap_image_runs(ids, 6, 8, 9, "s") == [1, 6, 6, 6, 4, 6, 6, 2]
    assert unwrap_image_runs([1, 2], 6, 8, 9, "s") == [1, 2]
    for bad in ([1, 8, 6, 6, 4], [1, 8, 9, 2], [1, 6, 6, 9], [1, 8, 6, 6]):
        with pytest.raises(EngineInputError, match=r"^s: "):
            unwrap_image_runs(bad, 6, 8, 9, "s")


def test_vllm_requests_of_internvl_are_one_context_token_an_image_without_its_wrappers(encoded):
    """What vLLM's InternVL replacement (`<IMG_CONTEXT>` -> `<img>` + tiles x 4 `<IMG_CONTEXT>` + `</img>`) expands
    back to exactly our ids; every tile count is vLLM's to recompute, checked by the exact-ids check."""
    batch, tokens, processor = encoded("internvl")
    wrappers = image_wrappers(processor)
    assert wrappers == ImageText(processor.start_image_token_id, processor.end_image_token_id, tiled=False)
    assert image_wrappers(object()) is None  # other processors: no wrappers to drop
    requests = vllm_requests(batch, tokens, wrappers)
    assert [r.prompt_ids for r in requests] == batch.prompt_ids
    start, end = wrappers.start, wrappers.end
    for i, request in enumerate(requests[1:], start=1):
        folded = request.payload["prompt_token_ids"]
        assert folded.count(tokens.image_token_id) == len(batch.images[i]) and start not in folded and end not in folded
        runs = placeholder_runs(batch.prompt_ids[i], tokens.image_token_id)
        expanded = []
        for tok in folded:
            expanded.extend([start] + [tok] * runs.pop(0) + [end] if tok == tokens.image_token_id else [tok])
        assert expanded == batch.prompt_ids[i]


def test_fold_tiled_images_folds_each_images_text_to_one_placeholder_and_refuses_any_other_layout():
    """SmolVLM: `<fake_token_around_image>` (4), `<global-img>` (6), `<image>` (5), a tile's `<row_1_col_1>` (7)."""
    tiles = [4, 7, 5, 5, 4, 8, 5, 5, 10, 10, 4, 6, 5, 5, 4]
    alone = [4, 6, 5, 5, 4]
    assert fold_tiled_images([1, *tiles, 3, *alone, *alone, 2], 5, 4, 6, "s") == [1, 5, 3, 5, 5, 2]
    assert fold_tiled_images([1, 2], 5, 4, 6, "s") == [1, 2]
    for bad in ([1, 4, 7, 5, 5, 2], [1, 4, 6, 4], [1, 4, 6, 5, 5], [1, 4, 6, 5, 5, 2]):
        with pytest.raises(EngineInputError, match=r"^s: "):
            fold_tiled_images(bad, 5, 4, 6, "s")


def test_vllm_requests_of_smolvlm_are_one_image_token_an_image_without_its_tiles(encoded):
    """vLLM's Idefics3 processor writes each image's tiles and whole-image text from the chat template's one `<image>`;
    the processor's own expansion of the folded prompt is our prompt again (what vLLM runs; a real vLLM engine
    checks it in tests/test_vllm_executed.py)."""
    batch, tokens, processor = encoded("smolvlm")
    text = image_wrappers(processor)
    convert = processor.tokenizer.convert_tokens_to_ids
    assert text == ImageText(convert("<fake_token_around_image>"), convert("<global-img>"), tiled=True)
    requests = vllm_requests(batch, tokens, text)
    assert [r.prompt_ids for r in requests] == batch.prompt_ids
    assert requests[0].payload == {"prompt_token_ids": batch.prompt_ids[0]}
    for i, request in enumerate(requests[1:], start=1):
        folded = request.payload["prompt_token_ids"]
        assert folded.count(tokens.image_token_id) == len(batch.images[i])
        assert text.start not in folded and text.end not in folded
        again = processor(text=[processor.tokenizer.decode(folded, skip_special_tokens=False)],
                          images=[list(batch.images[i])])["input_ids"][0]
        assert list(again) == batch.prompt_ids[i]


@pytest.mark.parametrize("arch", ARCHES)
def test_vllm_requests_carry_our_ids_folded_and_our_images(arch, encoded):
    batch, tokens, _ = encoded(arch)
    requests = vllm_requests(batch, tokens)
    assert [r.prompt_ids for r in requests] == batch.prompt_ids
    assert [r.name for r in requests] == ["<memory> (id 'text')", "<memory> (id 'one')", "<memory> (id 'three')"]
    # Text-only: the ids as they are, no media.
    assert requests[0].payload == {"prompt_token_ids": batch.prompt_ids[0]}
    for i, request in enumerate(requests[1:], start=1):
        visual = batch.visual.select([i])
        counts = tokens_per_item(visual.image_grid_thw, visual.merge_size)
        folded = request.payload["prompt_token_ids"]
        assert folded.count(tokens.image_token_id) == len(batch.images[i])  # one placeholder per image
        # What vLLM's prompt update does to the folded ids gives back exactly our prompt.
        assert expand_vision_placeholders(folded, tokens.image_token_id, tokens.video_token_id, counts, []) == \
            batch.prompt_ids[i]
        # The very PIL images our processor saw (already fitted to the patch grid), in prompt order.
        assert all(a is b for a, b in zip(request.payload["multi_modal_data"]["image"], batch.images[i], strict=True))


def test_vllm_video_request_keeps_frames_and_their_sampling(encoded):
    batch, tokens, _ = encoded("qwen2_5_vl", with_video=True)
    request = vllm_requests(batch, tokens)[3]
    frames, metadata = request.payload["multi_modal_data"]["video"][0]
    assert frames is batch.videos[3][0].frames
    assert metadata["frames_indices"] == [0, 1, 2, 3] and metadata["fps"] == 2.0
    assert request.payload["mm_processor_kwargs"] == {"do_sample_frames": False}  # never re-sampled
    visual = batch.visual.select([3])
    assert expand_vision_placeholders(request.payload["prompt_token_ids"], tokens.image_token_id,
                                      tokens.video_token_id, [], tokens_per_item(visual.video_grid_thw, 2)) == \
        batch.prompt_ids[3]


def test_vllm_refuses_qwen3_vl_video_naming_the_sample(encoded):
    batch, tokens, _ = encoded("qwen3_vl", with_video=True)
    with pytest.raises(EngineInputError, match=r"<memory> \(id 'video'\).*rollout.engine=sglang"):
        vllm_requests(batch, tokens)


@pytest.mark.parametrize("arch", ARCHES)
def test_sglang_requests_are_our_ids_and_our_tensors(arch, encoded):
    batch, _, _ = encoded(arch, with_video=arch != "qwen2_vl")
    requests = sglang_requests(batch)
    assert [r.payload["input_ids"] for r in requests] == batch.prompt_ids  # verbatim, expanded
    assert requests[0].payload["image_data"] == [None]  # text-only: SGLang's "no media" entry
    for i in range(1, len(batch)):
        (item,) = requests[i].payload["image_data"]
        assert isinstance(item, dict) and item["format"] == "processor_output"
        expected = {k: v for k, v in batch.visual.select([i]).model_inputs().items() if v.shape[0]}
        assert set(item) == {"format", *expected}
        for key, value in expected.items():
            assert torch.equal(item[key], value)
            # its own storage: pickling it to the engine process must not drag the whole batch along
            assert item[key].untyped_storage().nbytes() == value.numel() * value.element_size()
        grid_key = "image_grid_thw" if batch.images[i] else "video_grid_thw"
        assert torch.equal(getattr(item, grid_key), expected[grid_key])  # attribute access (SGLang M-RoPE path)
    if arch == "qwen2_5_vl":
        assert "second_per_grid_ts" in requests[3].payload["image_data"][0]  # video timing for M-RoPE


def test_processor_output_pickles_as_itself():
    import pickle

    item = ProcessorOutput(format="processor_output", image_grid_thw=torch.tensor([[1, 2, 2]]))
    back = pickle.loads(pickle.dumps(item))
    assert type(back) is ProcessorOutput and torch.equal(back.image_grid_thw, item["image_grid_thw"])
    with pytest.raises(AttributeError):
        back.pixel_values


# ---------------------------------------------------------------------------------------------- outputs


@dataclass
class FakeLogprob:
    """Stand-in for vllm.logprobs.Logprob."""

    logprob: float


@dataclass
class FakeCompletionOutput:
    """Stand-in for vllm.outputs.CompletionOutput (the fields vlrft reads)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, FakeLogprob]] | None = None


@dataclass
class FakeRequestOutput:
    """Stand-in for vllm.outputs.RequestOutput (the fields vlrft reads)."""

    prompt_token_ids: list[int] | None
    outputs: list[FakeCompletionOutput] = field(default_factory=list)


def completion(index, ids, reason, logprobs=None, extra=None):
    steps = None
    if logprobs is not None:
        steps = [{tok: FakeLogprob(lp), **({99: FakeLogprob(-9.0)} if extra else {})} for tok, lp in zip(ids, logprobs)]
    return FakeCompletionOutput(index, ids, reason, steps)


def request(ids, name="p0"):
    return PromptRequest({}, ids, name)


def decode_with(processor):
    return lambda ids: processor.tokenizer.batch_decode(ids, skip_special_tokens=True)


def test_vllm_outputs_become_rollouts(tiny_processor):
    processor = tiny_processor("qwen2_vl")
    eos = processor.tokenizer.eos_token_id
    words = processor.tokenizer.encode(" red circle", add_special_tokens=False)
    outputs = [FakeRequestOutput([5, 6, 7], [
        completion(1, words + [eos], "stop", [-0.5] * len(words) + [-0.1], extra=True),  # returned out of order
        completion(0, words * 3, "length", [-1.0] * len(words) * 3),
    ])]
    samples = vllm_samples(outputs, [request([5, 6, 7])], n=2)
    rollouts = to_rollouts(samples, 2, {eos}, len(words) * 3, decode_with(processor), ["p0"])
    assert rollouts.completion_ids == [words * 3, words + [eos]]  # by completion index
    assert rollouts.finish_reasons == ["length", "stop"]
    assert rollouts.logprobs == [[-1.0] * len(words) * 3, [-0.5] * len(words) + [-0.1]]  # the sampled token's
    assert rollouts.texts == [" red circle" * 3, " red circle"]


def test_completion_is_cut_after_the_first_stop_token():
    samples = [EngineSample([4, 2, 8, 8], [-1.0, -2.0, -3.0, -4.0], "stop")]
    rollouts = to_rollouts(samples, 1, {2}, 10, lambda ids: ["x"] * len(ids), ["p"])
    assert rollouts.completion_ids == [[4, 2]] and rollouts.logprobs == [[-1.0, -2.0]]
    assert rollouts.finish_reasons == ["stop"]


def test_finish_reasons_without_a_stop_token():
    stop_string = EngineSample([4, 5], None, "stop")  # a stop string ended it: a normal stop
    model_length = EngineSample([4, 5], None, "length")  # max_model_len hit before max_new_tokens: truncated
    rollouts = to_rollouts([stop_string, model_length], 1, {2}, 10, lambda ids: [""] * len(ids), ["a", "b"])
    assert rollouts.finish_reasons == ["stop", "length"] and rollouts.logprobs is None


def test_aborted_or_unfinished_requests_raise_naming_the_prompt():
    for reason in ("abort", "None"):
        with pytest.raises(EngineError, match=rf"q1, completion 1: the engine finished it with reason '{reason}'"):
            to_rollouts([EngineSample([1], None, "stop"), EngineSample([1], None, reason)], 2, {2}, 5,
                        lambda ids: [""] * len(ids), ["q1"])


def test_vllm_prompt_must_equal_ours():
    outputs = [FakeRequestOutput([5, 6, 6, 6, 7], [completion(0, [2], "stop")])]
    with pytest.raises(PromptMismatchError, match=r"sample 3: the engine ran a prompt of 5 tokens but ours has 4; they "
                                                  r"first differ at position 3 \(engine \[6, 7\], ours \[7\]\)"):
        vllm_samples(outputs, [request([5, 6, 6, 7], "sample 3")], n=1)


def test_vllm_output_count_and_logprob_checks():
    with pytest.raises(EngineError, match="returned 1 completions, expected n=2"):
        vllm_samples([FakeRequestOutput([1], [completion(0, [2], "stop")])], [request([1])], n=2)
    with pytest.raises(EngineError, match="returned 0 outputs for 1 prompts"):
        vllm_samples([], [request([1])], n=1)
    missing = FakeCompletionOutput(0, [4], "stop", [{5: FakeLogprob(-1.0)}])
    with pytest.raises(EngineError, match="lack the sampled token 4"):
        vllm_samples([FakeRequestOutput([1], [missing])], [request([1])], n=1)


def sglang_output(ids, logprobs, reason, prompt_tokens=3):
    return {"text": "?", "output_ids": [0] + ids,  # `output_ids` is not trusted (prompt tokens leaked into it)
            "meta_info": {"finish_reason": {"type": reason, "matched": 2}, "prompt_tokens": prompt_tokens,
                          "completion_tokens": len(ids),
                          "output_token_logprobs": [(lp, tok, None) for tok, lp in zip(ids, logprobs)]}}


def test_sglang_outputs_are_prompt_major():
    outputs = [sglang_output([4, 2], [-0.2, -0.3], "stop"), sglang_output([5, 5], [-1.0, -1.5], "length"),
               sglang_output([6, 2], [-0.7, -0.1], "stop")]
    samples = sglang_samples(outputs[:2] + outputs[2:] + [sglang_output([2], [-0.4], "stop")],
                             [request([1, 2, 3], "a"), request([1, 2, 3], "b")], n=2)
    assert [s.token_ids for s in samples] == [[4, 2], [5, 5], [6, 2], [2]]
    assert samples[0].logprobs == [-0.2, -0.3] and [s.finish_reason for s in samples] == ["stop", "length", "stop",
                                                                                          "stop"]


def test_sglang_output_checks():
    with pytest.raises(EngineError, match="returned 1 outputs for 1 prompts x n=2"):
        sglang_samples([sglang_output([2], [-1.0], "stop")], [request([1, 2, 3])], n=2)
    with pytest.raises(PromptMismatchError, match="p0: SGLang ran a prompt of 9 tokens but ours has 3"):
        sglang_samples([sglang_output([2], [-1.0], "stop", prompt_tokens=9)], [request([1, 2, 3])], n=1)
    samples = sglang_samples(sglang_output([2], [-1.0], "abort"), [request([1, 2, 3])], n=1)
    with pytest.raises(EngineError, match="'abort'"):
        to_rollouts(samples, 1, {2}, 4, lambda ids: [""] * len(ids), ["p0"])


# ---------------------------------------------------------------------------------------------- weights


def checkpoint_keys(folder) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            keys |= set(handle.keys())
    return keys


@pytest.mark.parametrize("arch", ARCHES)
def test_weights_are_sent_under_the_checkpoint_names(arch, tiny_vlm_dir):
    from vlrft.models.loading import load_policy

    folder = tiny_vlm_dir(arch)
    model = load_policy(folder)
    weights = PolicyWeights(model, torch.bfloat16)
    assert sorted(weights.names) == sorted(checkpoint_keys(folder))  # what the engine loaded at start-up
    sent = {name: t for bucket in weights.buckets(1 << 30, "cpu") for name, t in bucket}
    # transformers 5 keeps the embedding under one name in memory; Qwen2/2.5-VL checkpoints use the older layout.
    embedding = model.state_dict()["model.language_model.embed_tokens.weight"]
    checkpoint_name = "model.language_model.embed_tokens.weight" if arch == "qwen3_vl" else "model.embed_tokens.weight"
    assert sent[checkpoint_name].dtype == torch.bfloat16
    assert torch.equal(sent[checkpoint_name], embedding.to(torch.bfloat16))


def test_tied_embeddings_are_sent_once(tiny_vlm_dir):
    from vlrft.models.loading import load_policy

    folder = tiny_vlm_dir("qwen2_vl", tie_word_embeddings=True)
    model = load_policy(folder)
    names = PolicyWeights(model, torch.float32).names
    assert "lm_head.weight" not in names and len(names) == len(set(names))
    assert sorted(names) == sorted(checkpoint_keys(folder))


def test_buckets_are_bounded_and_cover_every_weight_once(tiny_vlm_dir):
    from vlrft.models.loading import load_policy

    model = load_policy(tiny_vlm_dir("qwen2_5_vl"))
    weights = PolicyWeights(model, torch.bfloat16)
    limit = 16 << 10
    buckets = list(weights.buckets(limit, "cpu"))
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        modules = {name.rsplit(".", 2)[0] for name, _ in bucket}
        assert size <= limit or len(modules) == 1  # only one module's weights bigger than a bucket travel alone
    assert [name for bucket in buckets for name, _ in bucket] == weights.names


# vLLM's fused layers of the Qwen-VL families (`packed_modules_mapping` / `stacked_params_mapping` in
# vllm/model_executor/models/qwen2.py, qwen2_5_vl.py, qwen3.py): (fused layer, the checkpoint projections it is made of)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.mark.parametrize("arch", ARCHES)
def test_buckets_never_split_a_layer_the_engine_fuses(arch, tiny_vlm_dir):
    """A bucket of one byte: every bucket is as small as it can be, yet q/k/v (and gate/up) of one layer, weights and
    biases, always travel together, since vLLM processes a fused layer once it has received all of it."""
    from vlrft.models.loading import load_policy

    weights = PolicyWeights(load_policy(tiny_vlm_dir(arch)), torch.float32)
    buckets = [[name for name, _ in bucket] for bucket in weights.buckets(1, "cpu")]
    assert len(buckets) > 10
    where = {name: k for k, bucket in enumerate(buckets) for name in bucket}
    checked = 0
    for name, k in where.items():
        if name.count(".") < 2:
            continue  # lm_head.weight
        module, leaf, param = name.rsplit(".", 2)
        for parts in FUSED.values():
            if leaf in parts:
                siblings = [f"{module}.{part}.{param}" for part in parts if f"{module}.{part}.{param}" in where]
                assert len(siblings) == len(parts), (name, siblings)  # the layer is complete in the checkpoint
                assert {where[s] for s in siblings} == {k}, f"{name}: its fused layer is split across buckets"
                checked += 1
    assert checked >= 5 * 2  # two decoder layers' q, k, v, gate, up at least


def _lora_actor(folder):
    """(an ActorVL with LoRA adapters whose B is non-zero, what PEFT's own merge of it sends)."""
    from vlrft.models.actor import ActorVL, apply_lora
    from vlrft.models.loading import load_policy

    peft_model = apply_lora(load_policy(folder), rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # LoRA starts at B = 0; give the adapters a real delta
            param.data.normal_(0, 0.5)
    reference = copy.deepcopy(peft_model).merge_and_unload()  # PEFT's own merge, on a copy
    reference_sent = {name: t for b in PolicyWeights(reference, torch.float32).buckets(1 << 30, "cpu") for name, t in b}
    return ActorVL(peft_model, image_token_id=6, video_token_id=7), reference_sent


def test_lora_policy_is_sent_merged_without_touching_the_trained_model(tiny_vlm_dir):
    folder = tiny_vlm_dir("qwen2_vl")
    actor, reference_sent = _lora_actor(folder)
    peft_model = actor.model
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}

    weights = PolicyWeights(actor, torch.float32)
    sent = {name: t for bucket in weights.buckets(1 << 30, "cpu") for name, t in bucket}
    assert sorted(sent) == sorted(checkpoint_keys(folder))  # no lora_A/lora_B/base_layer names
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q_proj], before["base_model.model.model.language_model.layers.0.self_attn.q_proj."
                                                "base_layer.weight"])  # the delta is really there
    for name, tensor in reference_sent.items():
        torch.testing.assert_close(sent[name], tensor, rtol=1e-6, atol=1e-6)
    after = peft_model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing merged into the trained model


def test_a_partitioned_lora_layer_is_gathered_with_its_adapters_one_tensor_at_a_time(tiny_vlm_dir):
    """ZeRO-3 partitions every parameter, a LoRA layer's adapters included (an ungathered adapter reads as an
    empty partition: a zero delta, no error). Here a gather that, like ZeRO-3's, holds parameters whole only
    inside its context: each sent tensor gathers all it reads, never two tensors' gathers at once."""
    actor, reference_sent = _lora_actor(tiny_vlm_dir("qwen2_vl"))
    whole = {id(p): p.data for p in actor.parameters()}
    for p in actor.parameters():
        p.data = torch.empty(0, dtype=p.dtype)  # partitioned: this rank holds nothing of it
    opened: list[int] = []

    @contextlib.contextmanager
    def gather(tensors):
        params = [t for t in tensors if id(t) in whole]  # buffers are never partitioned
        assert all(p.numel() == 0 for p in params)  # not nested in another tensor's gather
        opened.append(len(params))
        for p in params:
            p.data = whole[id(p)]
        try:
            yield
        finally:
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)

    sent = {name: t for bucket in PolicyWeights(actor, torch.float32, gather).buckets(1 << 30, "cpu")
            for name, t in bucket}
    assert sorted(sent) == sorted(reference_sent)
    for name, tensor in reference_sent.items():
        torch.testing.assert_close(sent[name], tensor, rtol=1e-6, atol=1e-6)
    assert max(opened) == 3  # a LoRA layer's weight with its A and B; every other tensor alone
    assert all(p.numel() == 0 for p in actor.parameters())  # nothing left gathered


class MockHostShardOfACudaMesh:
    """A mock of what cannot exist on a CPU machine: an FSDP2 `cpu_offload` shard, a DTensor whose local values
    live in host memory under a CUDA device mesh. It records where it was when gathered."""

    def __init__(self, values: torch.Tensor, device: str = "cpu", gathered_on: list[str] | None = None):
        self.values, self.device = values, torch.device(device)
        self.device_mesh = SimpleNamespace(device_type="cuda")
        self.gathered_on = [] if gathered_on is None else gathered_on

    def to(self, device):
        return MockHostShardOfACudaMesh(self.values, device, self.gathered_on)

    def full_tensor(self) -> torch.Tensor:
        self.gathered_on.append(self.device.type)
        return self.values


def test_an_offloaded_shard_is_gathered_on_its_meshs_device_not_over_the_cpu_group():
    """FSDP2 cpu_offload: gathering the host shard as it is would run the all-gather over gloo (the process
    group's CPU backend); the shard goes to the mesh's device first, as FSDP2's own unshard does."""
    shard = MockHostShardOfACudaMesh(torch.ones(3))
    on_mesh_device(shard).full_tensor()
    assert shard.gathered_on == ["cuda"]
    already = MockHostShardOfACudaMesh(torch.ones(3), device="cuda")
    assert on_mesh_device(already) is already  # no copy where the shard is already on its mesh's device


# ---------------------------------------------------------------------------------------------- lifecycle


@pytest.fixture
def engine_parts(tiny_vlm_dir, tiny_processor):
    from vlrft.models.loading import load_policy

    model = load_policy(tiny_vlm_dir("qwen2_vl"))
    processor = tiny_processor("qwen2_vl")
    return model, processor


def make_engine(model, processor, backend, sleep=True, requests=None):
    layout = RankLayout(0, 1, 1)
    return ColocatedEngine(backend, requests or (lambda batch: [request([1, 2, 3], "p0")]), layout, GroupComm(layout),
                           lambda: model, processor.tokenizer, tokens_of_model(processor, model),
                           EngineOptions(torch.float32, "cpu", sleep_between_steps=sleep, bucket_bytes=1 << 20),
                           every_rank_drives=True)


def tokens_of_model(processor, model):
    return TokenSpec.from_model(processor, model.config, model.generation_config)


def loads(backend):
    return [c for c in backend.calls if c != "load"]


def test_update_while_asleep_wakes_only_the_weights(engine_parts):
    model, processor = engine_parts
    backend = RecordingBackend()
    engine = make_engine(model, processor, backend)
    engine.sleep()
    engine.update_weights(model)
    assert loads(backend) == ["release", "resume_weights", "weights_loaded"] and engine.memory is Memory.WEIGHTS_ONLY
    assert sorted(backend.loaded) == sorted(PolicyWeights(model, torch.float32).names)
    engine.wake()
    assert loads(backend)[-1] == "resume_cache"  # no second weight load: the update was the latest
    assert backend.calls.count("weights_loaded") == 1 and engine.memory is Memory.AWAKE


def test_wake_after_sleep_without_update_reloads_the_policy(engine_parts):
    model, processor = engine_parts
    backend = RecordingBackend()
    engine = make_engine(model, processor, backend)
    engine.weights_current = True
    engine.sleep()
    engine.wake()
    assert loads(backend) == ["release", "resume_weights", "weights_loaded", "resume_cache"]
    assert "load" in backend.calls


def test_generate_while_asleep_wakes_first(engine_parts):
    model, processor = engine_parts
    backend = RecordingBackend([EngineSample([5, 2], [-0.1, -0.2], "stop")])
    engine = make_engine(model, processor, backend)
    engine.sleep()
    rollouts = engine.generate(batch=None, sampling=SamplingParams(n=1, max_new_tokens=4))
    assert loads(backend) == ["release", "resume_weights", "weights_loaded", "resume_cache", "run:1"]
    assert rollouts.completion_ids == [[5, 2]] and rollouts.finish_reasons == ["stop"]


def test_without_sleep_updates_load_in_place(engine_parts):
    model, processor = engine_parts
    backend = RecordingBackend()
    engine = make_engine(model, processor, backend, sleep=False)
    engine.sleep()
    engine.update_weights(model)
    engine.wake()
    assert loads(backend) == ["weights_loaded"]  # never released, the prefix cache still reset after the load


def test_update_weights_reads_the_live_parameters(engine_parts):
    model, processor = engine_parts
    received = {}

    class Keep(RecordingBackend):
        def load(self, buckets):
            received.update({name: t.clone() for bucket in buckets for name, t in bucket})

    engine = make_engine(model, processor, Keep())
    engine.update_weights(model)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    engine.update_weights(model)
    assert torch.equal(received["lm_head.weight"], model.lm_head.weight)


def test_weight_sync_holds_one_bucket_at_a_time(engine_parts, monkeypatch):
    """The engine's transient memory during a sync is one bucket (`rollout.weight_sync_bucket_mb`), not two."""
    from _bucket_watch import BucketWatch

    model, processor = engine_parts
    watch = BucketWatch(monkeypatch)
    layout = RankLayout(0, 1, 1)
    engine = ColocatedEngine(RecordingBackend(), lambda batch: [], layout, GroupComm(layout), lambda: model,
                             processor.tokenizer, tokens_of_model(processor, model),
                             EngineOptions(torch.float32, "cpu", bucket_bytes=1 << 16, gather=watch.gather),
                             every_rank_drives=True)
    engine.update_weights(model)
    assert len(watch.alive_at_each_gather) > 3
    assert watch.alive_at_each_gather == [0] * len(watch.alive_at_each_gather)


def test_bad_prompt_is_raised_before_the_engine_runs(engine_parts):
    model, processor = engine_parts
    backend = RecordingBackend()

    def refuse(batch):
        raise EngineInputError("sample x: cannot")

    engine = make_engine(model, processor, backend, requests=refuse)
    with pytest.raises(EngineInputError, match="sample x"):
        engine.generate(batch=None, sampling=SamplingParams())
    assert not any(c.startswith("run") for c in backend.calls)


# ---------------------------------------------------------------------------------------------- layout, config, imports


def test_rank_layout_groups_and_seeds():
    layouts = [RankLayout(rank, 4, 2) for rank in range(4)]
    assert [lay.group for lay in layouts] == [0, 0, 1, 1]
    assert [lay.leader for lay in layouts] == [0, 0, 2, 2] and [lay.is_leader for lay in layouts] == [1, 0, 1, 0]
    assert layouts[3].members == [2, 3]
    assert [lay.seed(42) for lay in layouts] == [42, 42, 43, 43]  # same within an engine, different across
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 .* divisor of the number of processes \\(4\\)"):
        RankLayout(0, 4, 3)


def test_config_checks_engine_fields():
    cfg = Config()
    cfg.rollout.engine, cfg.rollout.tensor_parallel_size = "vllm", 3
    cfg.rollout.global_batch_completions, cfg.rollout.n, cfg.train.strategy = 16, 4, "ddp"
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=3 .* divisor of the number of processes \(4\)"):
        cfg.validate(world_size=4)
    cfg.rollout.tensor_parallel_size, cfg.rollout.gpu_memory_utilization = 2, 1.5
    with pytest.raises(ConfigError, match="rollout.gpu_memory_utilization=1.5"):
        cfg.validate(world_size=4)
    cfg.rollout.gpu_memory_utilization, cfg.rollout.weight_sync_bucket_mb = 0.5, 0
    with pytest.raises(ConfigError, match="rollout.weight_sync_bucket_mb"):
        cfg.validate(world_size=4)
    cfg.rollout.weight_sync_bucket_mb = 256
    cfg.validate(world_size=4)


@pytest.mark.parametrize("module, package", [("vlrft.rollout.vllm", "vllm"), ("vlrft.rollout.sglang", "sglang")])
def test_engine_modules_import_without_the_engine(module, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here; this test checks the import without it")
    importlib.import_module(module)
    assert package not in sys.modules


@pytest.mark.parametrize("engine, extra", [("vllm", "vllm"), ("sglang", "sglang")])
def test_missing_engine_names_the_extra(engine, extra):
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    from vlrft.rollout import make_engine as build

    cfg = Config()
    cfg.rollout.engine = engine
    with pytest.raises(MissingDependencyError, match=rf"pip install 'vlrft\[{extra}\]'"):
        build(cfg, SimpleNamespace())


def run_two_ranks(tmp_path, every_rank_drives: bool, failing_rank: int = -1) -> list[dict]:
    import json

    import torch.multiprocessing as mp

    from engine_ranks import worker

    context = mp.start_processes(worker, args=(str(tmp_path), every_rank_drives, failing_rank), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):  # False while some process still runs
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the tensor-parallel group hung")
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("every_rank_drives", [True, False], ids=["vllm-style", "sglang-style"])
@pytest.mark.slow
def test_tensor_parallel_group_pools_prompts_and_returns_each_rank_its_own(tmp_path, every_rank_drives):
    rank0, rank1 = run_two_ranks(tmp_path, every_rank_drives)
    # rank 0 encoded 1 prompt ([0]), rank 1 two ([100], [101]); n=2 completions each, prompt-major.
    assert rank0["completions"] == [[0, 0, 2], [0, 1, 2]]
    assert rank1["completions"] == [[100, 0, 2], [100, 1, 2], [101, 0, 2], [101, 1, 2]]
    assert rank1["texts"][0] == "[100, 0, 2]"
    # One engine call on the pooled 3 prompts: on every member (vLLM) or on the leader only (SGLang).
    assert rank0["ran"] == [3] and rank1["ran"] == ([3] if every_rank_drives else None)


@pytest.mark.parametrize("every_rank_drives", [True, False], ids=["vllm-style", "sglang-style"])
@pytest.mark.slow
def test_a_refused_prompt_on_one_rank_fails_the_whole_group_without_hanging(tmp_path, every_rank_drives):
    rank0, rank1 = run_two_ranks(tmp_path, every_rank_drives, failing_rank=1)
    assert rank0["error"] == rank1["error"] == "rank 1: sample refused"
    assert not rank0["ran"]  # the engine never ran


def test_a_resumed_engine_samples_with_the_seeds_the_uninterrupted_one_would(engine_parts):
    """vLLM/SGLang calls are seeded by the engine's call count: a checkpoint keeps it (`engine_state`), so a resumed
    run does not sample its next steps with the seeds of its first ones."""
    import json

    from vlrft.rollout.base import engine_state, load_engine_state

    model, processor = engine_parts

    class SeedBackend(RecordingBackend):
        def __init__(self):
            super().__init__([EngineSample([5, 2], [-0.1, -0.2], "stop")])
            self.seeds = []

        def run(self, requests, sampling):
            self.seeds.append(torch.initial_seed())
            return super().run(requests, sampling)

    def run(engine, calls):
        for _ in range(calls):
            engine.generate(batch=None, sampling=SamplingParams(n=1, max_new_tokens=4))
        return engine.backend.seeds

    uninterrupted = run(make_engine(model, processor, SeedBackend(), sleep=False), 4)
    assert len(set(uninterrupted)) == 4
    first = make_engine(model, processor, SeedBackend(), sleep=False)
    run(first, 2)
    saved = json.loads(json.dumps(engine_state(first)))  # as trainer_state.json keeps it
    resumed = make_engine(model, processor, SeedBackend(), sleep=False)
    load_engine_state(resumed, saved)
    assert run(resumed, 2) == uninterrupted[2:]
    assert run(make_engine(model, processor, SeedBackend(), sleep=False), 1) == uninterrupted[:1]  # without the state


def test_fused_moe_experts_are_sent_in_the_released_layout(tiny_vlm_dir, tiny_processor):
    """Qwen3-VL-MoE: transformers keeps the experts fused as [experts, 2 x intermediate, hidden] and [experts, hidden,
    intermediate]; the release, and vLLM's loader (`is_fused_checkpoint_transposed`), have them transposed. The sync
    sends each expert tensor once, under its checkpoint name, swapped to the released layout, and nothing else is
    swapped; no weight is left that the sync could not send (the dense models only rename)."""
    import json

    from transformers import AutoModelForImageTextToText, Qwen3VLMoeConfig

    from vlrft.models.loading import load_policy
    from vlrft.models.weights import unsyncable_weights

    folder = tiny_vlm_dir("qwen3_vl")
    config = json.loads((folder / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[])
    for part in (text, vision):
        part.pop("model_type", None)
    ids = {k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    moe = AutoModelForImageTextToText.from_config(Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids))
    hidden = text["hidden_size"]
    assert unsyncable_weights(moe) == []

    class KeepingBackend(RecordingBackend):
        def load(self, buckets):
            self.sent = {name: tensor.clone() for bucket in buckets for name, tensor in bucket}

    backend = KeepingBackend()
    make_engine(moe, tiny_processor("qwen3_vl"), backend).update_weights(moe)
    memory = dict(moe.named_parameters())
    layer = "model.language_model.layers.0.mlp.experts."
    assert tuple(backend.sent[layer + "gate_up_proj"].shape) == (4, hidden, 2 * 48)  # the release's layout
    assert tuple(backend.sent[layer + "down_proj"].shape) == (4, 48, hidden)
    for name, tensor in memory.items():
        expected = tensor.detach().transpose(1, 2) if ".mlp.experts." in name else tensor.detach()
        assert torch.equal(backend.sent[name], expected), name
    assert len(backend.sent) == len(memory)
    for arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl"):  # InternViT's 3-D cls_token is as published
        assert unsyncable_weights(load_policy(tiny_vlm_dir(arch))) == []


REFUSED_ENGINES = [(engine, fam.model_type) for fam in FAMILIES for engine in ("vllm", "sglang", "vllm_server")
                   if not fam.engine(engine).supported]


@pytest.mark.parametrize("engine, family", REFUSED_ENGINES, ids=[f"{e}-{f}" for e, f in REFUSED_ENGINES])
def test_an_engine_the_family_table_refuses_for_a_family_is_one_line_with_its_reason(engine, family, tiny_vlm_dir,
                                                                                     tiny_processor):
    """Each engine the family table (vlrft/families.py) marks refused for a family stops before it starts, in one
    line giving the table's reason and the engines that take the family, instead of failing inside the server or
    syncing weights under the wrong names (Gemma 3's placeholders expand to text around the image tokens, which the
    prompt folding does not invert; the others were never run on that engine)."""
    from vlrft.errors import UserError
    from vlrft.families import family as family_of
    from vlrft.models.actor import ActorVL
    from vlrft.models.loading import load_policy
    from vlrft.rollout import EngineDeps, make_engine

    model = load_policy(tiny_vlm_dir(family))
    cfg = Config()
    cfg.rollout.engine = engine
    deps = EngineDeps(actor=ActorVL(model, model.config.image_token_id, getattr(model.config, "video_token_id", -1)),
                      processor=tiny_processor(family), tokens=None, strategy=None, prompts_per_rank=1)
    fam = family_of(family)
    takes = {"qwen3_vl_moe": "hf or vllm or vllm_server", "glm4v": "hf or vllm or vllm_server",
             "internvl": "hf or vllm or vllm_server", "llava_onevision": "hf or vllm or vllm_server",
             "smolvlm": "hf or vllm or vllm_server"}.get(family, "hf")
    with pytest.raises(UserError) as refused:
        make_engine(cfg, deps)
    assert str(refused.value) == (f"rollout.engine={engine} does not take {fam.name} ({family}): "
                                  f"{fam.engine(engine).refused}; use rollout.engine={takes}")

"""Contract tests: every vLLM / SGLang class, method, keyword and output field vlrft uses, checked
against the REAL installed package on CPU; and vLLM's own multimodal processor run on vlrft's requests.

They skip (saying so) where the package is not installed, so the default suite runs without the
engines; CI runs them in each engine stack's environment (constraints/vllm.txt,
constraints/sglang.txt, see .ci/run). A newer engine release that renames or drops something vlrft
calls fails here, on CPU, before anyone reaches a GPU. Nothing here is a stand-in: signatures come
from `inspect.signature` of the real classes, objects are built with the real constructors.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlrft.config import Config, DataConfig
from vlrft.data import PromptEncoder, Sample
from vlrft.rollout.base import SamplingParams
from vlrft.rollout.colocate import RankLayout
from vlrft.rollout.hf import TokenSpec
from vlrft.rollout.requests import pixel_bounds, sglang_requests, vllm_requests

REPO = Path(__file__).resolve().parents[1]
ARCHES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
TOKENS = TokenSpec(pad_id=0, eos_ids=(2, 9), image_token_id=6, video_token_id=7, suppressed_ids=(6, 7, 3))
SAMPLED = SamplingParams(n=4, max_new_tokens=33, min_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                         repetition_penalty=1.1, stop=("</answer>",), stop_token_ids=(9, 11))
GREEDY = SamplingParams(n=2, temperature=0.0, top_k=5)


def engine_package(name: str):
    """The real package, or a skip naming where these tests run. A package that is installed but fails
    to import is an error, not a skip (a broken stack must not pass)."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed here; CI runs the contract tests in the {name} stack's environment "
                    f"(pip install -c constraints/{name}.txt -e '.[{name},video,peft,dev]')")
    return importlib.import_module(name)


def parameters(func) -> set[str]:
    return set(inspect.signature(func).parameters)


def engine_config() -> Config:
    cfg = Config()
    cfg.model.path, cfg.model.dtype = "/models/qwen", "bfloat16"
    cfg.rollout.tensor_parallel_size = 2
    return cfg


PIXELS = {"image": {"min_pixels": 3136, "max_pixels": 12544}, "video": {"min_pixels": 3136, "max_pixels": 12544}}


def noise(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded_batch(processor, with_video: bool):
    samples = [
        Sample("one", "<image>What color is the shape?", images=[noise(64, 64, 1)]),
        Sample("three", "Compare <image> with <image> and <image>.",
               images=[noise(64, 64, 2), noise(128, 64, 3), noise(64, 128, 4)]),
    ]
    if with_video:
        samples.append(Sample("video", "<video>What happens?", videos=[[noise(64, 64, 10 + i) for i in range(4)]]))
    return PromptEncoder(processor, DataConfig(max_prompt_length=512, video_fps=2.0)).encode(samples).batch


# ============================================================================================== vLLM


@pytest.fixture(scope="module")
def vllm():
    return engine_package("vllm")


def test_vllm_engine_kwargs_are_engine_args_fields(vllm, tiny_vlm_dir):
    from vlrft.rollout.vllm import vllm_engine_kwargs

    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    cfg = engine_config()
    cfg.model.path = str(tiny_vlm_dir("qwen2_vl"))  # EngineArgs checks that the model exists
    kwargs = vllm_engine_kwargs(cfg, RankLayout(1, 2, 2), distributed=True, supported=fields, pixels=PIXELS)
    assert set(kwargs) <= fields, sorted(set(kwargs) - fields)
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # present: the installed vLLM has logprobs_mode
    from vllm.config.model import LogprobsMode
    from vllm.config.parallel import DistributedExecutorBackend

    assert "processed_logprobs" in typing.get_args(LogprobsMode)
    assert "external_launcher" in typing.get_args(DistributedExecutorBackend)
    args = vllm.EngineArgs(**kwargs)  # the real constructor takes every value as we pass it
    assert args.mm_processor_kwargs == PIXELS["image"] and args.enable_sleep_mode is True
    # The GPU tests' engine_kwargs are EngineArgs fields too.
    assert "enforce_eager" in fields


def test_vllm_llm_methods_and_keywords(vllm):
    llm = vllm.LLM
    assert {"prompts", "sampling_params", "use_tqdm"} <= parameters(llm.generate)
    assert "level" in parameters(llm.sleep) and "tags" in parameters(llm.wake_up)
    # Weight sync: one in-place reload per sync, run by the worker (`VLLMBackend.load`).
    assert {"method", "kwargs"} <= parameters(llm.collective_rpc)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker  # the CPU worker is a subclass: one reload path on both

    assert callable(Worker.reload_weights)  # forwards to the model runner's
    assert {"weights_iterator", "is_checkpoint_format"} <= parameters(GPUModelRunner.reload_weights)
    assert inspect.signature(llm.reset_prefix_cache).return_annotation in (bool, "bool")  # we check its answer
    assert inspect.signature(llm.wake_up).return_annotation in (bool, "bool")
    assert callable(llm.reset_mm_cache)
    from vllm.v1.engine.llm_engine import LLMEngine

    # The encoder-output cache (reused by image hash) is reset through LLM.llm_engine in this vLLM.
    assert callable(getattr(llm, "reset_encoder_cache", None) or LLMEngine.reset_encoder_cache)
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    assert callable(cleanup_dist_env_and_memory)


def test_vllm_sleep_tags_and_in_process_engine_switch(vllm):
    import vllm.envs as envs
    from vllm.v1.worker import gpu_worker

    source = inspect.getsource(gpu_worker)
    assert 'tag="weights"' in source and 'tag="kv_cache"' in source  # the tags our wake_up calls name
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in envs.environment_variables  # how we keep the engine in-process


def test_vllm_sampling_params_take_our_options(vllm):
    from vlrft.rollout.vllm import vllm_sampling_kwargs

    kwargs = vllm_sampling_kwargs(SAMPLED, TOKENS)
    params = vllm.SamplingParams(**kwargs)
    for key, value in kwargs.items():
        got = getattr(params, key)
        assert (list(got) if isinstance(value, list) else got) == value, key
    assert params.logit_bias[6] == -math.inf
    greedy = vllm.SamplingParams(**vllm_sampling_kwargs(dataclasses.replace(GREEDY, n=1), TOKENS, logprobs=False))
    assert greedy.temperature == 0.0 and greedy.top_k in (0, -1) and greedy.logprobs is None


def test_vllm_greedy_groups_are_decoded_once_and_repeated(vllm):
    """vLLM refuses `n > 1` with greedy sampling (SamplingParams validation); the backend asks for one."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from vlrft.rollout.requests import PromptRequest
    from vlrft.rollout.vllm import VLLMBackend

    class AnsweringLLM:
        """Stand-in for `vllm.LLM.generate` only: one canned completion per requested sample."""

        def generate(self, prompts, sampling_params, use_tqdm=False):
            self.params = sampling_params
            return [RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=p["prompt_token_ids"],
                                  prompt_logprobs=None, finished=True,
                                  outputs=[CompletionOutput(index=j, text="", token_ids=[4, 2], cumulative_logprob=None,
                                                            logprobs=None, finish_reason="stop")
                                           for j in range(sampling_params.n)])
                    for i, p in enumerate(prompts)]

    llm = AnsweringLLM()
    samples = VLLMBackend(llm, TOKENS, owns_distributed=False).run(
        [PromptRequest({"prompt_token_ids": [1, 3]}, [1, 3], "p")], GREEDY)
    assert llm.params.n == 1 and llm.params.temperature == 0.0  # a real, validated vllm.SamplingParams
    assert [s.token_ids for s in samples] == [[4, 2], [4, 2]]  # n = 2 rows, as the trainer expects


def test_vllm_prompt_dict_keys(vllm):
    from vllm.inputs import TokensPrompt

    keys = set(typing.get_type_hints(TokensPrompt))
    assert {"prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"} <= keys


def test_vllm_outputs_are_read_as_vlrft_reads_them(vllm):
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from vlrft.rollout.outputs import vllm_samples
    from vlrft.rollout.requests import PromptRequest

    assert {"index", "token_ids", "finish_reason", "logprobs"} <= {f.name for f in dataclasses.fields(CompletionOutput)}
    assert {"prompt_token_ids", "outputs"} <= parameters(RequestOutput.__init__)
    completions = [
        CompletionOutput(index=1, text="", token_ids=[5, 2], cumulative_logprob=None,
                         logprobs=[{5: Logprob(logprob=-0.5)}, {2: Logprob(logprob=-0.1), 7: Logprob(logprob=-3.0)}],
                         finish_reason="stop"),
        CompletionOutput(index=0, text="", token_ids=[4, 4], cumulative_logprob=None,
                         logprobs=[{4: Logprob(logprob=-1.0)}, {4: Logprob(logprob=-1.5)}], finish_reason="length"),
    ]
    output = RequestOutput(request_id="0", prompt=None, prompt_token_ids=[1, 3], prompt_logprobs=None,
                           outputs=completions, finished=True)
    samples = vllm_samples([output], [PromptRequest({}, [1, 3], "p")], n=2)
    assert [s.token_ids for s in samples] == [[4, 4], [5, 2]]
    assert [s.logprobs for s in samples] == [[-1.0, -1.5], [-0.5, -0.1]]
    assert [s.finish_reason for s in samples] == ["length", "stop"]


@pytest.fixture(scope="module")
def vllm_processor(vllm, tiny_vlm_dir):
    """`vllm_processor(arch)` -> (vLLM's multimodal processor built from vlrft's engine kwargs, our processor)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from vlrft.models.loading import load_processor
    from vlrft.rollout.vllm import vllm_engine_kwargs

    built: dict = {}

    def make(arch: str):
        if arch not in built:
            folder = tiny_vlm_dir(arch)
            processor = load_processor(folder)
            cfg = Config()
            cfg.model.path, cfg.model.dtype = str(folder), "float32"
            kwargs = vllm_engine_kwargs(cfg, RankLayout(0, 1, 1), distributed=False,
                                        supported={f.name for f in dataclasses.fields(vllm.EngineArgs)},
                                        pixels=pixel_bounds(processor, cfg.data))
            model_fields = parameters(ModelConfig)  # fields and init-only fields (mm_processor_kwargs is one)
            # Sleep mode needs a CUDA platform (ModelConfig refuses it on CPU); it plays no part in input processing.
            kwargs["enable_sleep_mode"] = False
            config = ModelConfig(**{k: v for k, v in kwargs.items() if k in model_fields})
            engine_wide = config.multimodal_config.mm_processor_kwargs
            assert engine_wide == kwargs["mm_processor_kwargs"]  # the trainer's pixel bounds reach the processor
            built[arch] = (MULTIMODAL_REGISTRY.create_processor(config), processor, folder)
        return built[arch]

    return make


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_vllm_processor_expands_our_folded_prompts_to_exactly_our_ids(arch, vllm_processor):
    """The path `LLM.generate` takes for a token prompt with images: vLLM's own HF-processor run and prompt
    update (placeholder expansion), as `BaseRenderer._process_multimodal` calls it."""
    from transformers import AutoConfig
    from vllm.multimodal.parse import parse_mm_uuids
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    mm_processor, processor, folder = vllm_processor(arch)
    batch = encoded_batch(processor, with_video=arch != "qwen3_vl")  # vLLM refuses Qwen3-VL videos (see requests)
    requests = vllm_requests(batch, TokenSpec.from_model(processor, AutoConfig.from_pretrained(folder)))
    assert len(requests) == (2 if arch == "qwen3_vl" else 3)
    for request in requests:
        payload = request.payload
        inputs = ProcessorInputs(payload["prompt_token_ids"], mm_processor.info.parse_mm_data(payload["multi_modal_data"]),
                                 parse_mm_uuids(None), hf_processor_mm_kwargs=payload.get("mm_processor_kwargs", {}),
                                 media_io_kwargs={}, cache=None)
        out = mm_processor.apply(inputs, TimingContext())
        assert out["prompt_token_ids"] == request.prompt_ids, request.name  # one tokenization, token for token
        assert len(payload["prompt_token_ids"]) < len(request.prompt_ids)  # it really was folded and re-expanded


def assert_engine_loads_every_weight(worker: str, dirs: list[str], out) -> None:
    """Run tests/WORKER (the engine's own model classes built on CPU with NaN parameters, our weight-sync buckets
    through their `load_weights`) and check: every parameter loaded and fully written, the sums equal to what was
    sent, and the LoRA variant's merged weights sent (not the base ones)."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / worker), str(out), *dirs],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-8000:]
    results = json.loads(out.read_text())
    assert len(results) == 2 * len(dirs)
    for key, result in results.items():
        assert result.get("unconsumed", {}) == {} and result.get("dropped", {}) == {}, key  # every tensor sent consumed
        assert result["params"] and result["loaded"] == result["params"], (key, set(result["params"]) - set(result["loaded"]))
        assert result["still_nan"] == [], key
        assert result["engine_sum"] == pytest.approx(result["sent_sum"], rel=1e-9, abs=1e-6), key
    for folder in dirs:  # the LoRA variant sent merged weights (its B matrices are non-zero), not the base ones
        assert results[f"{folder}|lora"]["sent_sum"] != pytest.approx(results[f"{folder}|full"]["sent_sum"], rel=1e-6)


@pytest.mark.slow
def test_vllm_model_classes_load_every_weight_our_sync_sends(vllm, tiny_vlm_dir, tmp_path):
    """vLLM's own Qwen2/2.5/3-VL classes, built on CPU with every parameter NaN, take our weight-sync buckets
    (checkpoint names, LoRA merged) through their `load_weights`: every parameter reported loaded and fully
    written, and what they hold sums to what we sent. A name vLLM does not map, or a weight we do not send,
    would leave an engine sampling from stale weights on a GPU. A tied LM head too: sent once, as the embedding,
    and every tensor sent consumed one at a time (the accounting both vLLM syncs run)."""
    dirs = [str(tiny_vlm_dir(arch)) for arch in ARCHES] + [str(tiny_vlm_dir("qwen2_vl", tie_word_embeddings=True))]
    assert_engine_loads_every_weight("vllm_load_worker.py", dirs, tmp_path / "loaded.json")


# ============================================================================================== SGLang


@pytest.fixture(scope="module")
def sglang():
    return engine_package("sglang")


def test_sglang_engine_kwargs_are_server_args(sglang):
    from sglang.srt.server_args import ServerArgs

    from vlrft.rollout.sglang import sglang_engine_kwargs

    fields = parameters(ServerArgs)
    kwargs = sglang_engine_kwargs(engine_config(), RankLayout(2, 4, 2), gpu_id=2, pixels=PIXELS)
    assert set(kwargs) <= fields, sorted(set(kwargs) - fields)
    assert "disable_cuda_graph" in fields  # the GPU tests' engine_kwargs
    args = ServerArgs(**kwargs)  # the real constructor takes every value as we pass it (resolution is later)
    assert args.mm_process_config == PIXELS and args.enable_memory_saver is True and args.tp_size == 2
    from sglang.srt.server_args import PortArgs

    assert PortArgs.init_new(args).nccl_port == kwargs["nccl_port"]  # the port SGLang's TP group store binds


def test_sglang_engine_methods_and_keywords(sglang):
    from sglang.srt.entrypoints.engine import Engine

    assert {"input_ids", "image_data", "sampling_params", "return_logprob"} <= parameters(Engine.generate)
    assert "tags" in parameters(Engine.release_memory_occupation)
    assert "tags" in parameters(Engine.resume_memory_occupation)
    assert {"named_tensors", "flush_cache", "load_format"} <= parameters(Engine.update_weights_from_tensor)
    for method in ("begin_weight_update", "end_weight_update", "flush_cache", "shutdown"):
        assert callable(getattr(Engine, method)), method


def test_sglang_memory_tags(sglang):
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_WEIGHTS

    from vlrft.rollout.sglang import WEIGHTS_TAG, _memory_tags

    assert GPU_MEMORY_TYPE_WEIGHTS == WEIGHTS_TAG
    assert set(_memory_tags()) == set(GPU_MEMORY_ALL_TYPES) and {"weights", "kv_cache"} <= set(GPU_MEMORY_ALL_TYPES)


def test_sglang_sampling_params_take_our_options(sglang):
    from sglang.srt.sampling.sampling_params import TOP_K_ALL
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    from vlrft.rollout.sglang import sglang_sampling_params

    params = sglang_sampling_params(SAMPLED, TOKENS)
    built = SGLangSamplingParams(**params)
    built.verify(vocab_size=1024)
    assert built.top_k == 20 and built.temperature == 0.7 and built.n == 4 and built.min_new_tokens == 3
    assert built.stop_token_ids == {2, 9, 11} and built.logit_bias["6"] == -math.inf
    greedy = SGLangSamplingParams(**sglang_sampling_params(GREEDY, TOKENS))
    greedy.verify(vocab_size=1024)
    assert greedy.top_k == 1  # temperature 0 -> SGLang's greedy
    off = SGLangSamplingParams(**sglang_sampling_params(SamplingParams(top_k=0), TOKENS))
    assert off.top_k == TOP_K_ALL  # our 0 (off) -> SGLang's -1 -> whole vocabulary


def test_sglang_accepts_our_batched_request(sglang, tiny_processor):
    from sglang.srt.managers.io_struct import GenerateReqInput

    from vlrft.rollout.sglang import sglang_sampling_params

    batch = encoded_batch(tiny_processor("qwen2_5_vl"), with_video=True)
    requests = sglang_requests(batch)
    text_only = {"input_ids": [1, 2, 3], "image_data": [None]}
    payloads = [r.payload for r in requests] + [text_only]
    obj = GenerateReqInput(input_ids=[p["input_ids"] for p in payloads],
                           image_data=[p["image_data"] for p in payloads],
                           sampling_params=sglang_sampling_params(SAMPLED, TOKENS), return_logprob=True)
    obj.normalize_batch_and_arguments()
    assert obj.batch_size == len(payloads) and obj.input_ids[0] == batch.prompt_ids[0]


def test_sglang_weight_payload_round_trips_through_sglangs_own_loader_path(sglang):
    """Our per-rank payload, as the engine serializes it to its workers and a TP worker unwraps it."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import _unwrap_tensor
    from sglang.srt.utils import MultiprocessingSerializer

    from vlrft.rollout.sglang import SGLangBackend, serialize_bucket

    weight = torch.randn(4, 3)
    packed = [serialize_bucket([("model.norm.weight", weight)]), serialize_bucket([("model.norm.weight", weight * 2)])]
    captured = {}

    class CapturingEngine:
        """Records the named tensors our backend hands to `Engine.update_weights_from_tensor`."""

        def begin_weight_update(self):
            return True, "Success"

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            captured["named"] = named_tensors
            return True, "Success"

    SGLangBackend(CapturingEngine(), TOKENS).load([packed])  # the real LocalSerializedTensor
    wire = MultiprocessingSerializer.serialize(captured["named"])  # what Engine sends each TP worker
    received = MultiprocessingSerializer.deserialize(wire)  # SGLang's restricted unpickler
    for rank, expected in enumerate((weight, weight * 2)):
        name, tensor = received[0]
        assert name == "model.norm.weight"
        assert torch.equal(_unwrap_tensor(tensor, tp_rank=rank, device="cpu"), expected)  # worker k gets rank k's


def test_sglang_output_fields_we_read(sglang):
    from sglang.srt.managers import tokenizer_manager

    source = inspect.getsource(tokenizer_manager)
    for key in ('"output_token_logprobs"', '"prompt_tokens"', '"completion_tokens"', '"finish_reason"'):
        assert key in source, key
    from sglang.srt.multimodal.processors import base_processor

    assert '"processor_output"' in inspect.getsource(base_processor)  # the media format our requests use


@pytest.mark.slow
def test_sglang_model_classes_load_every_weight_our_sync_sends(sglang, tiny_vlm_dir, tmp_path):
    """SGLang's own Qwen2/2.5/3-VL classes, built on CPU as its scheduler builds them (with the config overrides
    `SGLangEngine` passes), take our weight-sync buckets through their `load_weights`: SGLang skips names it does not
    know, so only the NaN check shows a parameter left at its old value."""
    assert_engine_loads_every_weight("sglang_load_worker.py", [str(tiny_vlm_dir(arch)) for arch in ARCHES],
                                     tmp_path / "loaded.json")

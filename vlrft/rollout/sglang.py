"""SGLang as a colocated rollout engine (`rollout.engine=sglang`; `pip install 'vlrft[sglang]'`, SGLang >= 0.5.23).

The first rank of each tensor-parallel group starts one `sglang.Engine` (its scheduler processes
run on that group's GPUs, `base_gpu_id` = the leader's GPU); the other members hand the leader
their prompts and get their completions back. Every rank holds a full replica of the policy on its
own GPU, and SGLang's tensor-parallel worker k loads the tensors of GPU k: each member serializes
its bucket (CUDA IPC handles, `MultiprocessingSerializer`), the leader sends one
`LocalSerializedTensor(values=[one payload per TP rank])` per weight through
`Engine.update_weights_from_tensor`, inside a weight-update session
(`begin_weight_update()` ... `end_weight_update()`; SGLang 0.5.23 refuses updates outside one), then
`flush_cache()`. Every call that returns a status is checked: a failure raises `EngineError` with
SGLang's message on every member, instead of sampling on from stale weights. Memory goes back and
forth with `release_memory_occupation(tags)` / `resume_memory_occupation(tags)` (needs
`enable_memory_saver=True`), weights first, KV cache (and CUDA graphs) after.

Prompts: our ids verbatim and our processor's tensors as one `processor_output` item per prompt
(see `vlrft.rollout.requests`): SGLang runs no processor and no tokenizer on them. Logprobs are the
engine's `output_token_logprobs`: log-softmax of the logits after temperature scaling only (SGLang's
default); top-k / top-p / min-p truncation is not applied to them.

Sources read (SGLang main 2025-2026):
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/entrypoints/engine.py (update_weights_from_tensor,
release/resume_memory_occupation)
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/managers/io_struct.py (batch image_data, [None])
https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/sampling/sampling_params.py (top_k -1, logit_bias)
SGLang docs, "Query VLM with Offline Engine" (processor_output inputs with input_ids)
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vlrft.errors import require
from vlrft.rollout.base import SamplingParams
from vlrft.rollout.colocate import (DTYPES, ColocatedEngine, EngineOptions, RankLayout,
                                    tensor_parallel_group)
from vlrft.rollout.outputs import EngineError, EngineSample, sglang_samples
from vlrft.rollout.requests import PromptRequest, pixel_bounds, sglang_requests

if TYPE_CHECKING:
    from vlrft.tokens import TokenSpec

SUPPRESSED_LOGIT_BIAS = float("-inf")
WEIGHTS_TAG = "weights"  # sglang.srt.constants.GPU_MEMORY_TYPE_WEIGHTS
DEFAULT_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang.srt.constants.GPU_MEMORY_ALL_TYPES


def sglang_sampling_params(sampling: SamplingParams, tokens: "TokenSpec") -> dict[str, Any]:
    """Our `SamplingParams` as SGLang's `sampling_params` dict, field by field."""
    stop_ids = list(dict.fromkeys([*tokens.eos_ids, *(int(i) for i in sampling.stop_token_ids)]))
    params: dict[str, Any] = dict(
        n=sampling.n,
        max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=sampling.min_new_tokens,
        temperature=0.0 if sampling.greedy else sampling.temperature,  # SGLang: 0 is greedy (top_k=1)
        top_p=1.0 if sampling.greedy else sampling.top_p,
        top_k=-1 if sampling.greedy or sampling.top_k <= 0 else sampling.top_k,  # SGLang: -1 is off
        min_p=0.0 if sampling.greedy else sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        stop=list(sampling.stop) or None,
        stop_token_ids=stop_ids,
        ignore_eos=False,
        skip_special_tokens=True,
    )
    if tokens.suppressed_ids:
        params["logit_bias"] = {str(int(i)): SUPPRESSED_LOGIT_BIAS for i in tokens.suppressed_ids}
    return params


def config_overrides(model_path: str | Path) -> dict[str, Any]:
    """What SGLang must be told about a checkpoint that its config.json does not say as SGLang reads it.

    SGLang's Qwen2-VL reads the vision tower's `in_chans`, which the Hub's Qwen2-VL config.json carries beside
    `in_channels`; transformers 5 writes only `in_channels`, so a Qwen2-VL folder it saved (a vlrft checkpoint's
    `model/`, a tiny test model) would stop SGLang when it builds the model. A model on the Hub is left alone.
    """
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    vision = config.get("vision_config") or {}
    if config.get("model_type") == "qwen2_vl" and "in_chans" not in vision and "in_channels" in vision:
        return {"vision_config": {"in_chans": vision["in_channels"]}}
    return {}


def sglang_engine_kwargs(cfg, layout: RankLayout, gpu_id: int,
                         pixels: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine` for a group leader on GPU `gpu_id`.

    `pixels` (`requests.pixel_bounds`: the trainer processor's image / video bounds) becomes
    SGLang's engine-wide `mm_process_config`, so its limits are ours.
    """
    r = cfg.rollout
    kwargs: dict[str, Any] = dict(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
        tp_size=r.tensor_parallel_size,
        base_gpu_id=gpu_id,
        mem_fraction_static=r.gpu_memory_utilization,
        # SGLang refuses a request whose input + max_new_tokens reaches its context length: one token more, so a
        # prompt of exactly data.max_prompt_length asking for the whole max_new_tokens is served
        context_length=r.engine_max_len(cfg.data.max_prompt_length) + (0 if r.max_model_len else 1),
        enable_memory_saver=r.sleep_between_steps,
        random_seed=layout.seed(cfg.train.seed),
        # Engines of one node must not share ports; those of different nodes may. By the leader's GPU on its node
        # (the job's engine index would pass 32768, Linux's ephemeral range, from 277 engines on).
        port=30000 + 10 * gpu_id,
        # left unset, SGLang draws its TP group's store port at random from 22000-29999 in each engine: eight
        # engines on a node collide about once in 300 starts (the second one's store fails to bind)
        nccl_port=30000 + 10 * gpu_id + 1,
        log_level="error",
    )
    if pixels:
        kwargs["mm_process_config"] = {kind: dict(bounds) for kind, bounds in pixels.items()}
    overrides = config_overrides(cfg.model.path)
    if overrides:  # rollout.engine_kwargs.json_model_override_args, if given, replaces this
        kwargs["json_model_override_args"] = json.dumps(overrides)
    kwargs.update(r.engine_kwargs)
    return kwargs


def check_status(result: Any, call: str) -> None:
    """Raise `EngineError` with SGLang's own message when `call` reports failure.

    SGLang answers `(success, message)` tuples (weight updates, sessions) or objects with
    `success` / `message` (`flush_cache`); `None` means the call reports nothing.
    """
    if result is None:
        return
    if isinstance(result, tuple):
        success, message = bool(result[0]), (str(result[1]) if len(result) > 1 else "")
    elif hasattr(result, "success"):
        success, message = bool(result.success), str(getattr(result, "message", ""))
    else:
        return
    if not success:
        raise EngineError(f"SGLang {call} failed: {message or 'no message'}")


def serialize_bucket(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, Any]]:
    """This rank's tensors as SGLang payloads (CUDA IPC handles: the tensors must stay alive until loaded)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    if any(tensor.is_cuda for _, tensor in bucket):
        monkey_patch_torch_reductions()  # CUDA handles name GPUs by UUID, as SGLang's workers expect
    return [(name, MultiprocessingSerializer.serialize(tensor)) for name, tensor in bucket]


def _memory_tags() -> tuple[str, ...]:
    try:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
    except ImportError:
        return DEFAULT_MEMORY_TAGS
    return tuple(GPU_MEMORY_ALL_TYPES)


def _local_serialized_tensor():
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    return LocalSerializedTensor


class SGLangBackend:
    """`Backend` over an `sglang.Engine` owned by this (leader) rank.

    `load` receives, per weight bucket, one serialized bucket per tensor-parallel rank (member order).
    `local_tensor` builds SGLang's per-rank wrapper (`LocalSerializedTensor`); tests pass their own.
    """

    def __init__(self, engine, tokens: "TokenSpec", local_tensor=None, tags: tuple[str, ...] | None = None):
        self.engine = engine
        self.tokens = tokens
        self.tags = tags or _memory_tags()
        self.local_tensor = local_tensor or _local_serialized_tensor()
        self.session_open = False

    def run(self, requests: list[PromptRequest], sampling: SamplingParams) -> list[EngineSample]:
        image_data = [r.payload["image_data"] for r in requests]
        outputs = self.engine.generate(
            input_ids=[r.payload["input_ids"] for r in requests],
            image_data=image_data if any(item is not None for items in image_data for item in items) else None,
            sampling_params=sglang_sampling_params(sampling, self.tokens),
            return_logprob=True,
        )
        return sglang_samples(outputs, requests, sampling.n)

    def release(self) -> None:
        check_status(self.engine.release_memory_occupation(tags=list(self.tags)), "release_memory_occupation")

    def resume_weights(self) -> None:
        check_status(self.engine.resume_memory_occupation(tags=[WEIGHTS_TAG]), "resume_memory_occupation")

    def resume_cache(self) -> None:
        check_status(self.engine.resume_memory_occupation(tags=[t for t in self.tags if t != WEIGHTS_TAG]),
                     "resume_memory_occupation")

    def load(self, buckets: Iterable[list[list[tuple[str, Any]]]]) -> None:
        """Each bucket is `per_rank`: `per_rank[k]` is TP rank k's serialized copy of it (same names, same order)."""
        for per_rank in buckets:
            self._load_bucket(per_rank)

    def _load_bucket(self, per_rank: list[list[tuple[str, Any]]]) -> None:
        names = [name for name, _ in per_rank[0]]
        if any([name for name, _ in part] != names for part in per_rank):
            raise EngineError("SGLang weight sync: the tensor-parallel ranks serialized different weights")
        if not self.session_open:
            check_status(self.engine.begin_weight_update(), "begin_weight_update")
            self.session_open = True
        named = [(name, self.local_tensor(values=[part[i][1] for part in per_rank])) for i, name in enumerate(names)]
        try:
            check_status(self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False),
                         "update_weights_from_tensor")
        except EngineError:
            self._end_session()
            raise

    def weights_loaded(self) -> None:
        if self.session_open:
            self._end_session()
        # Cached prefixes (KV and preprocessed media) were computed with the old weights.
        check_status(self.engine.flush_cache(), "flush_cache")

    def _end_session(self) -> None:
        self.session_open = False
        check_status(self.engine.end_weight_update(), "end_weight_update")

    def close(self) -> None:
        self.engine.shutdown()


class SGLangEngine(ColocatedEngine):
    """SGLang rollouts colocated with the trainer; see the module docstring."""

    @classmethod
    def from_deps(cls, cfg, deps) -> "SGLangEngine":
        sgl = require("sglang", "rollout.engine=sglang", extra="sglang")
        strategy = deps.strategy
        layout, comm = tensor_parallel_group(cfg, strategy.rank, strategy.world_size)
        backend = None
        if layout.is_leader:
            device = torch.device(strategy.device)
            gpu_id = device.index if device.index is not None else 0
            pixels = pixel_bounds(deps.processor, cfg.data)
            backend = SGLangBackend(sgl.Engine(**sglang_engine_kwargs(cfg, layout, gpu_id, pixels)), deps.tokens)
        actor = deps.actor
        engine = cls(
            backend=backend,
            build_requests=sglang_requests,
            layout=layout, comm=comm, get_policy=lambda: actor, tokenizer=deps.processor.tokenizer,
            tokens=deps.tokens,
            options=EngineOptions(dtype=DTYPES[cfg.model.dtype], device=strategy.device,
                                  sleep_between_steps=cfg.rollout.sleep_between_steps,
                                  bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20, gather=strategy.gathered,
                                  seed=layout.seed(cfg.train.seed)),
            every_rank_drives=False,
            pack_bucket=serialize_bucket,
        )
        if deps.sync_weights_at_start:  # the engine loaded the checkpoint from disk; the policy may differ
            engine.update_weights(actor)
        return engine

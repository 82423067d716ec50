"""Typed run configuration: dataclass sections loaded from YAML with dotted command-line overrides.

    cfg = load_config("configs/demo.yaml", ["train.lr=1e-6", "rollout.n=8"])

OmegaConf parses and merges the YAML file and the overrides (so `${...}` interpolation works);
`build_dataclass` then turns the merged tree into these dataclasses, rejecting unknown keys and
wrong types, and `Config.validate` checks values against each other. Every error is one
`ConfigError` line naming the key, the value given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vlrft.errors import ConfigError

SECRET = {"secret": True}  # field metadata: never written to the saved config


@dataclass
class LoraConfig:
    """LoRA through PEFT; rank 0 means full fine-tuning."""

    rank: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class ModelConfig:
    path: str = ""  # local folder or Hub-format checkpoint with a processor
    build_recipe: str | None = None  # build model.path with this recipe when it does not exist (vlrft.models.recipes)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    freeze_vision_tower: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    ref_path: str | None = None  # reference policy for KL; defaults to `path`
    critic_path: str | None = None  # value model for GAE; defaults to `path` with a fresh value head


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    format: Literal["auto", "native", "easyr1", "verl", "trl", "openrlhf"] = "auto"
    image_root: str | None = None  # relative image paths resolve against this (default: the data file's folder)
    system_prompt: str | None = None
    prompt_suffix: str | None = None  # appended to every user prompt, e.g. an answer-format instruction
    max_prompt_length: int = 1024  # tokens, vision tokens included; longer prompts are errors or skips
    min_pixels: int = 28 * 28 * 4
    max_pixels: int = 28 * 28 * 1024
    video_fps: float = 2.0
    video_max_frames: int = 32
    on_bad_sample: Literal["error", "skip"] = "error"
    max_source_pixels: int = 89_478_485  # images larger than this (width*height) are refused before decoding (bombs)
    max_aspect_ratio: float = 200.0  # images longer than this ratio are refused (Qwen-VL cannot patch them)
    shuffle: bool = True
    max_train_samples: int | None = None
    max_eval_samples: int | None = None


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    n: int = 8  # completions per prompt (the group size)
    batch_size: int = 64  # completions per step over all ranks (= prompts per step * n)
    max_new_tokens: int = 512
    min_new_tokens: int = 0  # stop tokens are not sampled before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM / SGLang only
    gpu_memory_utilization: float = 0.5  # fraction of the GPU the engine may take (vLLM) / static memory (SGLang)
    tensor_parallel_size: int = 1  # ranks sharing one engine (within a node); must divide the number of processes
    sleep_between_steps: bool = True  # release engine weights + KV cache while the trainer runs
    max_model_len: int | None = None  # default: data.max_prompt_length + rollout.max_new_tokens
    weight_sync_bucket_mb: int = 512  # weights are sent to the engine in buckets of about this size
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed verbatim to vllm.LLM / sglang.Engine


@dataclass
class RewardFunctionConfig:
    """One reward function: a built-in name, `module:function` or `path.py:function`, with a weight."""

    name: str = ""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments (a factory class gets them once)
    alias: str | None = None  # key in metrics and RewardResult.per_function; default: the function's name


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    # label -> functions for that label; samples whose label is not here use `functions`
    recipes: dict[str, list[RewardFunctionConfig]] = field(default_factory=dict)
    timeout_s: float = 30.0
    on_error: Literal["raise", "none"] = "raise"  # "none": an error counts as "not applicable"
    max_concurrency: int = 16  # reward function calls running at once
    remote_url: str | None = None  # default URL of the "remote" reward function
    remote_api_key: str | None = field(default=None, metadata=SECRET)  # else the VLRFT_REWARD_API_KEY variable
    # Math answers are graded (math-verify/sympy) in worker processes that are killed when they overrun:
    grader_processes: int = 0  # per rank; 0 = min(4, CPU cores / local ranks)
    grader_timeout_s: float = 5.0  # per answer; an answer that takes longer to grade scores 0
    grader_memory_mb: int = 2048  # address-space limit of each grader process


@dataclass
class AlgorithmConfig:
    # built-ins: grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, cpgd; or a name added with
    # vlrft.algo.register_advantage (registered before the config is validated)
    advantage: str = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    policy_loss: str = "ppo"  # built-ins: ppo, gspo, cpgd; or a name added with vlrft.algo.register_policy_loss
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None  # e.g. 3.0
    kl_coef: float = 0.0  # beta; 0 means no reference model is loaded
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    kl_target: float = 0.1
    kl_horizon: int = 10000
    entropy_coef: float = 0.0
    high_entropy_token_frac: float | None = None  # train only on the top fraction of tokens by entropy
    tis_cap: float | None = None  # truncated importance sampling vs the engine's logprobs
    gamma: float = 1.0
    lam: float = 1.0
    value_clip: float = 0.2
    value_coef: float = 0.5
    overlong_buffer: int = 0  # tokens before max_new_tokens where the overlong penalty starts; 0 = off
    overlong_penalty: float = 1.0
    reward_clip: float | None = None
    normalize_rewards: bool = False  # running mean/std normalisation of rewards
    mask_truncated: bool = False  # completions that hit max_new_tokens get no gradient
    dynamic_sampling: bool = False  # drop zero-variance groups and refill from new prompts
    max_refill_rounds: int = 4
    adv_eps: float = 1e-6  # added to every std an advantage is divided by (GRPO, batch scale, whitening)
    gae_whiten: bool = True  # whiten GAE advantages once over the whole batch (all ranks), as PPO does
    # GSPO clips the length-normalised sequence ratio, which moves far less than token ratios (paper: 3e-4 / 4e-4)
    gspo_clip_eps_low: float = 3e-4
    gspo_clip_eps_high: float = 4e-4
    # CPGD (arXiv:2505.12504): advantage weight after group-mean centring: "std" (divide by the group std),
    # "clip_filter" (multiply by groups / groups-with-nonzero-variance, capped at cpgd_weight_cap), "none"
    cpgd_weight: Literal["std", "clip_filter", "none"] = "std"
    cpgd_weight_cap: float = 3.0
    cpgd_drift_coef: float = 0.01  # alpha, weight of the policy-drift term KL(pi_old || pi_theta); 0 = off
    cpgd_drift_clip: float = 2.0  # cap on (ratio - 1) in the drift gradient, as in the reference implementation


@dataclass
class FSDPConfig:
    """train.strategy=fsdp2: parameters, gradients and optimizer state sharded over all ranks."""

    cpu_offload: bool = False  # keep the shards (and optimizer state) in host memory (CPUOffloadPolicy)
    reshard_after_forward: bool = True  # free gathered layers after forward (less memory, one more all-gather)
    mixed_precision: bool = True  # on GPUs: compute in model.dtype, reduce gradients in float32


@dataclass
class DeepSpeedConfig:
    """train.strategy=deepspeed: DeepSpeed ZeRO (needs the `deepspeed` extra)."""

    zero_stage: int = 3  # 2: shard gradients and optimizer state; 3: shard the weights too
    offload_optimizer: bool = False  # keep optimizer state (and its step) in host memory
    offload_param: bool = False  # ZeRO-3 only: keep the weight shards in host memory between uses


@dataclass
class TrainConfig:
    output_dir: str = "runs/vlrft"
    total_steps: int = 100
    seed: int = 42
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    mini_batch_size: int | None = None  # completions per optimizer step (all ranks); default: the rollout batch
    micro_batch_size: int = 4  # completions per forward pass per rank
    # under torchrun: "ddp" (replicated) or "fsdp2" (sharded); gloo on CPU, NCCL on GPUs
    strategy: Literal["single", "ddp", "fsdp2", "deepspeed"] = "single"
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # train.strategy=deepspeed (ZeRO-2/3)
    save_every: int = 0  # steps; 0 = only at the end
    keep_last: int = 2
    resume: str = "none"  # "none", "auto" (latest checkpoint in output_dir) or a checkpoint path
    eval_every: int = 0  # steps; 0 = no periodic eval
    eval_before_training: bool = True
    eval_n: int = 1  # samples per eval prompt (pass@k uses them)
    eval_temperature: float = 0.0  # 0 = greedy
    eval_batch_size: int = 32  # prompts per eval generate call
    eval_accuracy_reward: str | None = None  # reward function whose value > 0.5 means correct; default: the first


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "vlrft"
    wandb_run_name: str | None = None
    wandb_api_key: str | None = field(default=None, metadata=SECRET)  # prefer the WANDB_API_KEY variable
    log_every: int = 1
    completions_every: int = 10  # steps between completion tables; 0 = never
    completions_rows: int = 8
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def prompts_per_step(self) -> int:
        return self.rollout.batch_size // self.rollout.n

    def validate(self, world_size: int | None = None) -> "Config":
        """Check values against each other; raises `ConfigError` naming the first problem."""
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        r, t, a = self.rollout, self.train, self.algorithm
        _positive("rollout.n", r.n)
        _positive("rollout.batch_size", r.batch_size)
        _positive("rollout.max_new_tokens", r.max_new_tokens)
        _positive("train.micro_batch_size", t.micro_batch_size)
        _positive("train.ppo_epochs", t.ppo_epochs)
        _positive("data.max_prompt_length", self.data.max_prompt_length)
        d = self.data
        _positive("data.min_pixels", d.min_pixels)
        _positive("data.video_max_frames", d.video_max_frames)
        _positive("data.max_source_pixels", d.max_source_pixels)
        if d.max_pixels < d.min_pixels:
            _fail("data.max_pixels", d.max_pixels, f"at least data.min_pixels={d.min_pixels}")
        if d.video_fps <= 0:
            _fail("data.video_fps", d.video_fps, "a number > 0 (frames sampled per second of video)")
        if d.max_aspect_ratio < 1:
            _fail("data.max_aspect_ratio", d.max_aspect_ratio, "a number >= 1")
        if r.engine != "hf":
            if not 0 < r.gpu_memory_utilization <= 1:
                _fail("rollout.gpu_memory_utilization", r.gpu_memory_utilization, "a fraction in (0, 1]")
            _positive("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb)
            _positive("rollout.tensor_parallel_size", r.tensor_parallel_size)
            if world % r.tensor_parallel_size:
                _fail("rollout.tensor_parallel_size", r.tensor_parallel_size,
                      f"a divisor of the number of processes ({world}); each group of that many ranks shares one engine")
        if r.batch_size % r.n:
            _fail("rollout.batch_size", r.batch_size,
                  f"a multiple of rollout.n={r.n} (each prompt's group of {r.n} completions stays whole)")
        if self.prompts_per_step % world:
            _fail("rollout.batch_size", r.batch_size,
                  f"a multiple of rollout.n * world_size = {r.n * world} so every one of the {world} ranks gets whole groups")
        if t.mini_batch_size is not None:
            _positive("train.mini_batch_size", t.mini_batch_size)
            if r.batch_size % t.mini_batch_size:
                _fail("train.mini_batch_size", t.mini_batch_size, f"a divisor of rollout.batch_size={r.batch_size}")
            if t.mini_batch_size % world:
                _fail("train.mini_batch_size", t.mini_batch_size, f"a multiple of world_size={world}")
        if not 0 <= a.clip_eps_low < 1:
            _fail("algorithm.clip_eps_low", a.clip_eps_low, "a number in [0, 1)")
        if a.clip_eps_high < 0:
            _fail("algorithm.clip_eps_high", a.clip_eps_high, "a number >= 0")
        if a.dual_clip is not None and a.dual_clip <= 1:
            _fail("algorithm.dual_clip", a.dual_clip, "a number > 1 (e.g. 3.0) or null to disable")
        if a.kl_coef < 0:
            _fail("algorithm.kl_coef", a.kl_coef, "a number >= 0")
        _check_registered("algorithm.advantage", a.advantage, BUILTIN_ADVANTAGES, "advantages", "ADVANTAGE_ESTIMATORS",
                          "register_advantage")
        _check_registered("algorithm.policy_loss", a.policy_loss, BUILTIN_POLICY_LOSSES, "losses", "POLICY_LOSSES",
                          "register_policy_loss")
        if a.advantage == "rloo" and r.n < 2:
            _fail("rollout.n", r.n, "at least 2 for algorithm.advantage=rloo (leave-one-out needs siblings)")
        if a.high_entropy_token_frac is not None and not 0 < a.high_entropy_token_frac <= 1:
            _fail("algorithm.high_entropy_token_frac", a.high_entropy_token_frac, "a fraction in (0, 1] or null")
        adaptive = a.kl_controller == "adaptive"
        for key, ok, allowed in (
            ("tis_cap", a.tis_cap is None or a.tis_cap > 0, "a number > 0 (e.g. 2.0) or null to disable"),
            ("adv_eps", a.adv_eps > 0, "a small number > 0 (e.g. 1e-6)"),
            ("gamma", 0 <= a.gamma <= 1, "a number in [0, 1]"),
            ("lam", 0 <= a.lam <= 1, "a number in [0, 1]"),
            ("kl_target", not adaptive or a.kl_target > 0, "a number > 0 with kl_controller=adaptive"),
            ("kl_horizon", not adaptive or a.kl_horizon > 0, "a positive integer with kl_controller=adaptive"),
            ("reward_clip", a.reward_clip is None or a.reward_clip > 0, "a number > 0 or null to disable"),
            ("value_clip", a.value_clip > 0, "a number > 0 (e.g. 0.2)"),
            ("gspo_clip_eps_low", 0 <= a.gspo_clip_eps_low < 1, "a number in [0, 1) (default 3e-4)"),
            ("gspo_clip_eps_high", a.gspo_clip_eps_high >= 0, "a number >= 0 (default 4e-4)"),
            ("cpgd_drift_coef", a.cpgd_drift_coef >= 0, "a number >= 0 (0 turns the drift term off)"),
            ("cpgd_drift_clip", a.cpgd_drift_clip > 0, "a number > 0 (default 2.0)"),
            ("cpgd_weight_cap", a.cpgd_weight_cap >= 1, "a number >= 1 (default 3.0)"),
        ):
            if not ok:
                _fail(f"algorithm.{key}", getattr(a, key), allowed)
        if a.overlong_buffer >= r.max_new_tokens and a.overlong_buffer > 0:
            _fail("algorithm.overlong_buffer", a.overlong_buffer, f"less than rollout.max_new_tokens={r.max_new_tokens}")
        if t.lr <= 0:
            _fail("train.lr", t.lr, "a number > 0")
        if len(t.adam_betas) != 2:
            _fail("train.adam_betas", t.adam_betas, "two numbers, e.g. [0.9, 0.999]")
        if t.resume not in ("none", "auto") and not Path(t.resume).exists():
            _fail("train.resume", t.resume, "'none', 'auto' or the path of an existing checkpoint folder")
        if t.strategy == "single" and world > 1:
            _fail("train.strategy", t.strategy, f"'ddp', 'fsdp2' or 'deepspeed' when running {world} processes")
        if t.deepspeed.zero_stage not in (2, 3):
            _fail("train.deepspeed.zero_stage", t.deepspeed.zero_stage, "2 or 3")
        if t.deepspeed.offload_param and t.deepspeed.zero_stage != 3:
            _fail("train.deepspeed.offload_param", True, "false with zero_stage=2 (only ZeRO-3 shards the weights)")
        return self


def _fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"config: {key}={value!r} is not allowed; expected {allowed}")


BUILTIN_ADVANTAGES = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "cpgd")
BUILTIN_POLICY_LOSSES = ("ppo", "gspo", "cpgd")


def _check_registered(key: str, name: str, builtins: tuple[str, ...], module: str, registry: str,
                      decorator: str) -> None:
    """Accept a built-in name at once; only for other names import the (torch-based) registry to look it up."""
    if name in builtins:
        return
    import importlib

    known = getattr(importlib.import_module(f"vlrft.algo.{module}"), registry)
    if name not in known:
        names = [*builtins, *sorted(set(known) - set(builtins))]
        raise ConfigError(f"config: {key}={name!r} is invalid; expected one of {', '.join(map(repr, names))} "
                          f"(or a name registered with vlrft.algo.{decorator})")


def _positive(key: str, value: int) -> None:
    if value <= 0:
        _fail(key, value, "a positive integer")


# ----------------------------------------------------------------------------------------------
# dict -> dataclasses, strictly typed


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string",
            Any: "any value"}.get(tp, getattr(tp, "__name__", str(tp)))


class _Mismatch(Exception):
    pass


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Return `value` as type `tp` or raise `_Mismatch` (the caller words the message)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return build_dataclass(tp, value, key)
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _Mismatch
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise _Mismatch
        return [_coerce_or_fail(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Mismatch
        return {str(k): _coerce_or_fail(item, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    raise TypeError(f"config field {key} has an unsupported type {tp!r}")


def _coerce_or_fail(tp: Any, value: Any, key: str) -> Any:
    try:
        return _coerce(tp, value, key)
    except _Mismatch:
        raise ConfigError(f"config: {key}={value!r} is invalid; expected {_type_name(tp)}") from None


def build_dataclass(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, naming the full key of any unknown or mistyped entry."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
            where = f"'{prefix}'" if prefix else "the top level"
            raise ConfigError(f"config: unknown key '{full}'{hint}; allowed keys in {where}: {', '.join(names)}")
        kwargs[key] = _coerce_or_fail(hints[key], value, full)
    return cls(**kwargs)


def to_dict(obj: Any, redact_secrets: bool = False) -> Any:
    """Dataclass tree -> plain dict; secret fields become None when `redact_secrets`."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if redact_secrets and f.metadata.get("secret"):
                value = None
            out[f.name] = to_dict(value, redact_secrets)
        return out
    if isinstance(obj, list):
        return [to_dict(v, redact_secrets) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, redact_secrets) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------------------------
# loading and saving


def _parse_overrides(overrides: list[str]):
    from omegaconf import OmegaConf

    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"config: override '{item}' is not of the form section.key=value (e.g. train.lr=1e-6)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except Exception as exc:
        raise ConfigError(f"config: could not parse overrides {overrides}: {exc}") from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None,
                validate: bool = True) -> Config:
    """Load a YAML config (or defaults when `path` is None), apply `section.key=value` overrides, validate."""
    import yaml
    from omegaconf import OmegaConf

    merged = OmegaConf.create({})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' not found; pass the path of a YAML file such as configs/demo.yaml")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}; fix the file") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections (model:, data:, ...), not {type(raw).__name__}")
        merged = OmegaConf.create(raw)
    if overrides:
        merged = OmegaConf.merge(merged, _parse_overrides(list(overrides)))
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except Exception as exc:
        raise ConfigError(f"config: could not resolve interpolations: {exc}") from None
    cfg = build_dataclass(Config, data)
    return cfg.validate(world_size) if validate else cfg


def save_config(cfg: Config, out_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config (secrets removed) next to a run's outputs."""
    import yaml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / name
    target.write_text(yaml.safe_dump(to_dict(cfg, redact_secrets=True), sort_keys=False), encoding="utf-8")
    return target

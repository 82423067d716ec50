"""Typed run configuration: dataclass sections loaded from YAML with dotted command-line overrides.

    cfg = load_config("configs/demo.yaml", ["train.lr=1e-6", "rollout.n=8"])

OmegaConf parses and merges the YAML file and the overrides (so `${...}` interpolation works);
`build_dataclass` then turns the merged tree into these dataclasses, rejecting unknown keys and
wrong types, and `Config.validate` checks values against each other and that every advantage,
policy-loss and reward name resolves (vlrft.registry), so a bad setting fails at load time, before
any model or data is read. Every error is one `ConfigError` line naming the key, the value given
and what is allowed. Every field carries its help text (`option(default, "help")`), which
`vlrft config --explain KEY` and docs/config.md show; old key names load through DEPRECATED_KEYS.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from vlrft.errors import ConfigError
from vlrft.registry import ADVANTAGES, POLICY_LOSSES, REWARDS

SECRET = {"secret": True}  # field metadata: never written to the saved config


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           secret: bool = False, minimum: int | None = None, maximum: int | None = None) -> Any:
    """A dataclass field with its help text, which `vlrft config --explain` and docs/config.md show.

    `factory` builds a mutable default (a list or dict); `secret` keeps the value out of saved configs.
    `minimum` / `maximum`: the range of an integer option (of each item of a list of integers; null stays
    allowed where the type allows it), checked at load (`validate_numbers`) and shown in docs/config.md.
    Every integer option states one (a test checks), so `eval_batch_prompts=0` fails at load, not at the
    first evaluation.
    """
    metadata: dict[str, Any] = {"help": help}
    if secret:
        metadata.update(SECRET)
    if minimum is not None or maximum is not None:
        metadata["range"] = (minimum, maximum)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class LoraConfig:
    """LoRA through PEFT; rank 0 means full fine-tuning."""

    rank: int = option(0, "LoRA rank; 0 = full fine-tuning (every parameter trains)", minimum=0)
    alpha: int = option(16, "LoRA scaling numerator (the update is scaled by alpha / rank)", minimum=1)
    dropout: float = option(0.0, "dropout on the LoRA adapters' input")
    target_modules: list[str] = option(help="modules that get adapters: ['all-linear'] or module names such as "
                                       "['q_proj', 'v_proj']", factory=lambda: ["all-linear"])


@dataclass
class ModelConfig:
    """The policy, and the reference and critic models derived from it."""

    path: str = option("", "the policy: a local folder (or Hub-format checkpoint) with weights and a processor")
    build_recipe: str | None = option(None, "build model.path with this function ('module:function' or "
                                      "'path/to/file.py:function', given the folder to fill) when it does not exist "
                                      "yet, e.g. examples/demo_models.py:build_shapes_demo")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "bfloat16", "compute dtype on GPU: the reference model's weights, the policy's autocast in training and in the "
        "hf engine's sampling, FSDP2's gathers (the policy's weights and optimizer stay float32); CPU computes in "
        "float32 (VLRFT_CPU_MIXED_PRECISION=1 takes the GPU's mixed precision there, for tests)")
    attn_implementation: str = option("sdpa", "transformers attention kernel: 'sdpa', 'eager' or 'flash_attention_2'")
    trust_remote_code: bool = option(False, "allow model folders that ship their own Python code (transformers' "
                                     "trust_remote_code)")
    gradient_checkpointing: bool = option(False, "recompute activations in backward: less memory, about a third "
                                          "more compute")
    freeze_vision_tower: bool = option(False, "train only the language model; the vision encoder (and its "
                                       "merger) gets no gradient")
    lora: LoraConfig = option(help="LoRA adapters (model.lora.rank > 0 turns them on)", factory=LoraConfig)
    ref_path: str | None = option(None, "reference policy for the KL term; default: model.path (loaded only "
                                  "when algorithm.kl_coef > 0)")
    critic_path: str | None = option(None, "value model for algorithm.advantage=gae; default: model.path with a "
                                     "fresh value head")


@dataclass
class DataConfig:
    """Training and evaluation data, and how images, videos and prompts are prepared."""

    train_files: list[str] = option(help="training data files (JSONL, JSON, Parquet, CSV); see data.format",
                                    factory=list)
    eval_files: list[str] = option(help="evaluation data files, same formats; empty = no evaluation", factory=list)
    format: Literal["auto", "native", "easyr1", "verl", "trl", "openrlhf"] = option(
        "auto", "field layout of the data files; 'auto' recognises each of the others from the columns")
    image_root: str | None = option(None, "relative image paths resolve against this folder (default: the data "
                                    "file's folder); absolute paths and symlinks are followed wherever they point "
                                    "(docs/design.md, Media paths)")
    system_prompt: str | None = option(None, "system message put before every prompt; null = none")
    prompt_suffix: str | None = option(None, "text appended to every user prompt, e.g. an answer-format "
                                       "instruction")
    max_prompt_length: int = option(1024, "tokens, vision tokens included; a longer prompt is an error or a skip "
                                    "(data.on_bad_sample)", minimum=1)
    min_pixels: int = option(28 * 28 * 4, "images smaller than this (width*height) are scaled up to it before "
                             "patching (fewer vision tokens: lower it)", minimum=1)
    max_pixels: int = option(28 * 28 * 1024, "images larger than this (width*height) are scaled down to it; the "
                             "main knob for vision tokens per image", minimum=1)
    video_fps: float = option(2.0, "frames sampled per second of video")
    video_max_frames: int = option(32, "at most this many frames per video", minimum=1)
    on_bad_sample: Literal["error", "skip"] = option(
        "error", "an unreadable or over-long sample: 'error' stops with its id, 'skip' drops it and counts it")
    validate_media: bool = option(True, "before training, check every prompt, decode every image once and open "
                                  "every video file (cached by file fingerprint; each rank checks its share); bad "
                                  "ones are errors or skips per data.on_bad_sample")
    max_source_pixels: int = option(89_478_485, "images larger than this (width*height) are refused before "
                                    "decoding (decompression bombs)", minimum=1)
    max_aspect_ratio: float = option(200.0, "images longer than this ratio are refused (Qwen-VL cannot patch them)")
    shuffle: bool = option(True, "shuffle the training prompts each epoch (seeded by train.seed)")
    max_train_samples: int | None = option(None, "use only the first N training samples; null = all", minimum=1)
    max_eval_samples: int | None = option(None, "use only the first N evaluation samples; null = all", minimum=1)


@dataclass
class ToolConfig:
    """One tool of multi-turn rollouts: a built-in name, `module:function` or `path.py:function`."""

    name: str = option("", "a built-in tool ('zoom', 'crop'), 'module:function' or 'path.py:function'")
    alias: str | None = option(None, "the name the model calls it by; default: the tool's registered name")
    description: str | None = option(None, "what the model is told the tool does; default: the tool's own")
    parameters: dict[str, Any] | None = option(None, "JSON schema of the arguments; default: the tool's own")
    kwargs: dict[str, Any] = option(help="fixed keyword arguments, in ToolContext.kwargs", factory=dict)


@dataclass
class RolloutConfig:
    """Sampling completions: the engine, the batch and the sampling options."""

    engine: Literal["hf", "vllm", "sglang", "vllm_server"] = option(
        "hf", "'hf': transformers on the policy itself (no extra memory); 'vllm' / 'sglang': a colocated engine on "
        "the GPU (much faster sampling); 'vllm_server': vLLM servers of their own (rollout.server_urls, "
        "docs/engines.md 'Rollout servers')")
    n: int = option(8, "completions per prompt (the group size of GRPO/RLOO)", minimum=1)
    global_batch_completions: int = option(64, "completions per step over all ranks (= prompts per step * "
                                           "rollout.n); was rollout.batch_size", minimum=1)
    max_new_tokens: int = option(512, "longest completion in tokens; longer ones are cut and flagged as truncated", minimum=1)
    min_new_tokens: int = option(0, "stop tokens are not sampled before this many tokens", minimum=0)
    temperature: float = option(1.0, "sampling temperature; 0 = greedy. The trainer's logprobs use the same one")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability; 1 = off")
    top_k: int = option(0, "sample only among the k most likely tokens; 0 = off", minimum=-1)
    min_p: float = option(0.0, "drop tokens less likely than min_p times the most likely one; 0 = off")
    repetition_penalty: float = option(1.0, "divide the logits of tokens already in the sequence by this; 1 = off")
    stop: list[str] = option(help="stop strings; the completion ends right after the first one", factory=list)
    stop_token_ids: list[int] = option(help="extra token ids that end a completion (besides the model's EOS)",
                                       factory=list, minimum=0)
    lean_decode: bool = option(True, "hf engine: Qwen2/2.5/3-VL decode steps run the layers' arithmetic directly "
                               "(weights read in place, preallocated KV cache) instead of through transformers' "
                               "modules (LoRA adapters as base weight + delta); other models and DoRA decode through "
                               "transformers")
    cuda_graph_decode: bool | None = option(None, "hf engine, lean decoding: record the decode step once per "
                                            "generate call as a CUDA graph and replay it per token (every row "
                                            "computed until all stop, attention over all max_new_tokens positions). "
                                            "None = on CUDA devices (an H100 sampled 3.8-4.3x the tokens/s of "
                                            "eager lean steps, forced lengths, one process: docs/gpu_results.md), "
                                            "off elsewhere; true off CUDA runs the "
                                            "same fixed-shape steps eagerly (slower)")
    # vLLM / SGLang only
    gpu_memory_utilization: float = option(0.5, "vLLM/SGLang: fraction of the GPU the engine may take (vLLM) / "
                                           "its static memory (SGLang)")
    tensor_parallel_size: int = option(1, "vLLM/SGLang: ranks sharing one engine (within a node); must divide the "
                                       "number of processes", minimum=1)
    sleep_between_steps: bool = option(True, "vLLM/SGLang: release engine weights and KV cache while the trainer "
                                       "runs")
    max_model_len: int | None = option(None, "vLLM/SGLang: longest sequence; default: data.max_prompt_length + "
                                       "rollout.max_new_tokens (with tools: + rollout.max_trajectory_tokens; SGLang + 1)", minimum=1)
    weight_sync_bucket_mb: int = option(512, "vLLM/SGLang: weights are sent to the engine in buckets of about "
                                        "this many MB", minimum=1)
    engine_kwargs: dict[str, Any] = option(help="vLLM/SGLang: passed verbatim to vllm.LLM / sglang.Engine",
                                           factory=dict)
    # Rollout servers (rollout.engine=vllm_server)
    server_urls: list[str] = option(help="vllm_server: the vLLM servers' base URLs, e.g. [http://10.0.0.5:8000]; a "
                                    "prompt's group goes to the one with the fewest outstanding requests",
                                    factory=list)
    server_timeout_s: float = option(600.0, "vllm_server: seconds one request may take before its server counts as "
                                     "dead (its requests go to the others)")
    max_staleness: int = option(0, "vllm_server: policy versions a rollout may lag behind the weights it trains: "
                                "0 = synchronous (generate, then train); k >= 1 = the servers generate the next "
                                "steps while the trainer trains, each rollout at most k syncs old", minimum=0)
    # Multi-turn rollouts with tools (docs/multiturn.md); off while `tools` is empty
    tools: list[ToolConfig] = option(help="tools the model may call (list of {name, alias, description, "
                                     "parameters, kwargs}); non-empty turns on multi-turn rollouts", factory=list)
    max_turns: int = option(4, "multi-turn: most model turns per trajectory (tools answer at most max_turns - 1 "
                            "calls)", minimum=1)
    max_trajectory_tokens: int = option(2048, "multi-turn: most tokens after the prompt per trajectory (model "
                                        "turns, tool outputs and their images); past it the trajectory is truncated", minimum=1)
    tool_timeout_s: float = option(30.0, "multi-turn: seconds one tool call may take; then the model reads a "
                                   "timeout error and the call is counted in tools/timeouts")
    tool_max_concurrency: int = option(16, "multi-turn: tool calls running at once (across the batch)", minimum=1)
    tool_parser: str = option("qwen", "multi-turn: how a turn's tool call is found: 'qwen' (<tool_call>{\"name\": ..., "
                              "\"arguments\": {...}}</tool_call>) or 'module:function' / 'path.py:function' mapping "
                              "the turn's text to a vlrft.tools.ToolCall, MalformedCall or None (no call)")
    tool_image_max_pixels: int = option(0, "multi-turn: most pixels of an image a tool returns (a zoomed crop can be "
                                        "shown sharper than the prompt's image); 0: data.max_pixels; capped by the "
                                        "processor's own max_pixels", minimum=0)
    tool_max_output_tokens: int = option(0, "multi-turn: most tokens of a tool's text the model reads; longer text is "
                                         "cut (a note says how much) and counted in tools/truncated_outputs; 0: no "
                                         "cap (an observation past max_trajectory_tokens ends the trajectory)", minimum=0)
    describe_tools: bool = option(True, "multi-turn: describe the tools (their JSON schemas) in every prompt, through "
                                  "the chat template's tools; false when the data's prompts already say how to call "
                                  "them (the schemas cost hundreds of prompt tokens)")

    def validate_tools(self) -> None:
        """Multi-turn limits and that every tool name resolves (at load time, not mid-run)."""
        if not self.tools:
            return
        from vlrft.registry import TOOLS

        _positive("rollout.max_turns", self.max_turns)
        _positive("rollout.max_trajectory_tokens", self.max_trajectory_tokens)
        _positive("rollout.tool_max_concurrency", self.tool_max_concurrency)
        if self.tool_image_max_pixels < 0:
            _fail("rollout.tool_image_max_pixels", self.tool_image_max_pixels, "0 (as data.max_pixels) or a pixel count")
        if self.tool_timeout_s <= 0:
            _fail("rollout.tool_timeout_s", self.tool_timeout_s, "a number of seconds > 0")
        if self.tool_parser != "qwen":
            from vlrft.registry import load_reference

            load_reference(self.tool_parser, f"rollout.tool_parser={self.tool_parser!r}")
        for i, spec in enumerate(self.tools):
            if not spec.name:
                _fail(f"rollout.tools[{i}].name", spec.name, "a tool: a built-in name, 'module:function' or "
                      "'path.py:function'")
            try:
                TOOLS.is_known(spec.name)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("rollout.tools[*].name", f"rollout.tools[{i}].name", 1)) from None

    @property
    def tokens_after_prompt(self) -> int:
        """Most tokens a row holds after its prompt: one completion, or with tools a whole trajectory."""
        return self.max_trajectory_tokens if self.tools else self.max_new_tokens

    def engine_max_len(self, max_prompt_length: int) -> int:
        """vLLM/SGLang's longest sequence: `max_model_len`, else a request's longest input plus the tokens it asks for.

        Without tools the input is the prompt. With tools a later turn's input is the prompt and the trajectory so
        far, and one `max_new_tokens` is asked for all rows of a turn (what a row has no room for is cut after).
        A length over the model's own limit is refused by the engine at start; set `max_model_len` then.
        """
        if self.max_model_len:
            return self.max_model_len
        return max_prompt_length + (self.max_trajectory_tokens if self.tools else 0) + self.max_new_tokens

    @property
    def batch_size(self) -> int:
        """Old name of `global_batch_completions`, for code written against it (config files get a warning)."""
        return self.global_batch_completions


@dataclass
class RewardFunctionConfig:
    """One reward function: a built-in name, `module:function` or `path.py:function`, with a weight."""

    name: str = option("", "a built-in reward (see docs/rewards.md), 'module:function' or 'path.py:function'")
    weight: float = option(1.0, "the reward is the weighted sum of the functions' values")
    kwargs: dict[str, Any] = option(help="fixed keyword arguments (a factory class gets them once)", factory=dict)
    alias: str | None = option(None, "key in metrics and RewardResult.per_function; default: the function's name")


@dataclass
class RewardConfig:
    """Reward functions, per-label recipes, timeouts and the math grader processes."""

    functions: list[RewardFunctionConfig] = option(
        help="reward functions of every sample (list of {name, weight, kwargs, alias})", factory=list)
    recipes: dict[str, list[RewardFunctionConfig]] = option(
        help="label -> reward functions for samples with that label; other samples use reward.functions",
        factory=dict)
    timeout_s: float = option(30.0, "seconds one reward call may take before it fails (see reward.on_error)")
    on_error: Literal["raise", "none"] = option(
        "raise", "a reward function that raises or times out: 'raise' stops the run naming it, 'none' counts the "
        "reward as not applicable")
    max_concurrency: int = option(16, "reward function calls running at once", minimum=1)
    remote_url: str | None = option(None, "default URL of the 'remote' reward function (vlrft reward-server)")
    remote_api_key: str | None = option(None, "API key of the 'remote' reward; else the VLRFT_REWARD_API_KEY "
                                        "variable (never saved)", secret=True)
    # Math answers are graded (math-verify/sympy) in worker processes that are killed when they overrun:
    grader_processes: int = option(0, "math grader processes per rank; 0 = min(4, CPU cores / local ranks)", minimum=0)
    grader_timeout_s: float = option(5.0, "seconds to grade one math answer; an answer that takes longer scores 0")
    grader_memory_mb: int = option(2048, "address-space limit of each math grader process, in MB", minimum=1)

    def validate(self) -> None:
        """Timeouts and limits, and that every reward function name resolves (at load time, not mid-run)."""
        for key, ok, allowed in (
            ("timeout_s", self.timeout_s > 0, "a number of seconds > 0"),
            ("grader_timeout_s", self.grader_timeout_s > 0, "a number of seconds > 0"),
            ("max_concurrency", self.max_concurrency > 0, "a positive integer"),
            ("grader_processes", self.grader_processes >= 0, "an integer >= 0 (0 = automatic)"),
            ("grader_memory_mb", self.grader_memory_mb > 0, "a positive number of MB"),
        ):
            if not ok:
                _fail(f"reward.{key}", getattr(self, key), allowed)
        groups = [("reward.functions", self.functions)]
        groups += [(f"reward.recipes.{label}", fns) for label, fns in self.recipes.items()]
        for where, functions in groups:
            for i, fn in enumerate(functions):
                key = f"{where}[{i}].name"
                if not fn.name:
                    _fail(key, fn.name, "a reward function: a built-in name, 'module:function' or 'path.py:function'")
                try:
                    REWARDS.is_known(fn.name)
                except ConfigError as exc:
                    raise ConfigError(str(exc).replace("reward.functions[*].name", key, 1)) from None


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss, KL control and reward shaping (docs/design.md has the formulas)."""

    advantage: str = option(
        "grpo", "advantage estimator: grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, cpgd; a name "
        "added with vlrft.algo.register_advantage; or 'module:function' / 'path.py:function'")
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "GRPO's divisor: the group's std ('group'), the batch's std ('batch'), or none (Dr. GRPO)")
    policy_loss: str = option(
        "ppo", "policy loss: ppo, gspo, cpgd; a name added with vlrft.algo.register_policy_loss; or "
        "'module:function' / 'path.py:function'")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = option(
        "token-mean", "how token losses become one number: mean over all tokens (DAPO), mean of per-sequence means "
        "(GRPO paper), or sums (Dr. GRPO: seq-mean-token-sum-norm divides by max_new_tokens)")
    clip_eps_low: float = option(0.2, "PPO clip: the ratio may fall to 1 - clip_eps_low")
    clip_eps_high: float = option(0.2, "PPO clip: the ratio may rise to 1 + clip_eps_high (DAPO clip-higher: 0.28)")
    dual_clip: float | None = option(None, "dual-clip PPO: bound the loss of negative advantages at this times "
                                     "the advantage (e.g. 3.0); null = off")
    kl_coef: float = option(0.0, "beta, the weight of KL(policy || reference); 0 = no KL and no reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = option("k3", "per-token KL estimate (Schulman): k1 = d, k2 = d^2/2, "
                                                      "k3 = exp(-d) - 1 + d with d = logp - logp_ref")
    kl_k3_clamp: float | None = option(10.0, "k3 is clamped to [-x, x] as verl and OpenRLHF do (a token far "
                                       "below the reference adds no huge gradient); null = off")
    kl_in: Literal["loss", "reward"] = option(
        "loss", "where the KL goes: added to the loss ('loss', GRPO) or subtracted from the rewards before "
        "advantages ('reward', PPO/RLHF)")
    kl_controller: Literal["fixed", "adaptive"] = option(
        "fixed", "'fixed' keeps kl_coef; 'adaptive' steers the measured KL to kl_target (Ziegler et al. 2019)")
    kl_target: float = option(0.1, "adaptive KL controller: the KL it steers to")
    kl_horizon: int = option(10000, "adaptive KL controller: horizon in completions (larger = slower changes)", minimum=1)
    entropy_coef: float = option(0.0, "entropy bonus: the loss subtracts this times the mean token entropy")
    high_entropy_token_frac: float | None = option(
        None, "train only on this top fraction of tokens by entropy (the 80/20 rule paper: 0.2); null = all")
    tis_cap: float | None = option(
        None, "truncated importance sampling: weight each token by min(p_policy / p_engine, tis_cap) to correct "
        "the engine/trainer mismatch (e.g. 2.0); null = off")
    gamma: float = option(1.0, "discount of token returns (REINFORCE++, GAE)")
    lam: float = option(1.0, "GAE lambda")
    value_clip: float = option(0.2, "critic: new values may move this far from the old ones before the clipped "
                               "loss takes over")
    value_coef: float = option(0.5, "weight of the critic's loss")
    overlong_buffer: int = option(0, "DAPO overlong penalty: it ramps up over the last this-many tokens before "
                                  "max_new_tokens; 0 = off", minimum=0)
    overlong_penalty: float = option(1.0, "DAPO overlong penalty at and beyond max_new_tokens")
    reward_clip: float | None = option(None, "clip rewards to [-x, x] before advantages; null = off")
    normalize_rewards: bool = option(False, "normalise rewards by their running mean and std (checkpointed)")
    mask_truncated: bool = option(False, "completions that hit max_new_tokens get no gradient (they still count "
                                  "in their group's statistics)")
    dynamic_sampling: bool = option(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and "
                                    "refill with new prompts")
    max_refill_rounds: int = option(4, "dynamic sampling: at most this many extra rollout rounds per step", minimum=0)
    adv_eps: float = option(1e-6, "added to every std an advantage is divided by (GRPO, batch scale, whitening)")
    gae_whiten: bool = option(True, "whiten GAE advantages once over the whole batch (all ranks), as PPO does")
    # GSPO clips the length-normalised sequence ratio, which moves far less than token ratios (paper: 3e-4 / 4e-4)
    gspo_clip_eps_low: float = option(3e-4, "GSPO: the sequence ratio may fall to 1 - this")
    gspo_clip_eps_high: float = option(4e-4, "GSPO: the sequence ratio may rise to 1 + this")
    # CPGD (arXiv:2505.12504): advantage weight after group-mean centring: "std" (divide by the group std),
    # "clip_filter" (multiply by groups / groups-with-nonzero-variance, capped at cpgd_weight_cap), "none"
    cpgd_weight: Literal["std", "clip_filter", "none"] = option(
        "std", "CPGD advantage weight after group-mean centring: divide by the group std, multiply by groups / "
        "groups-with-nonzero-variance ('clip_filter'), or none")
    cpgd_weight_cap: float = option(3.0, "CPGD clip_filter: the weight's upper bound")
    cpgd_drift_coef: float = option(0.01, "CPGD: alpha, weight of the policy-drift term KL(pi_old || pi_theta); "
                                    "0 = off")
    cpgd_drift_clip: float = option(2.0, "CPGD: cap on (ratio - 1) in the drift gradient, as in the reference "
                                    "implementation")


@dataclass
class FSDPConfig:
    """train.strategy=fsdp2: parameters, gradients and optimizer state sharded over all ranks."""

    cpu_offload: bool = option(False, "keep the shards and optimizer state in host memory (CPUOffloadPolicy): "
                               "less GPU memory, slower steps")
    reshard_after_forward: bool = option(True, "free gathered layers after forward (less memory, one more "
                                         "all-gather in backward)")
    mixed_precision: bool = option(True, "on GPUs: compute in model.dtype, reduce gradients in float32")
    offload_during_rollout: bool | None = option(
        None, "move this rank's parameter shards, gradients and optimizer state (and the reference's shards) to "
        "host memory while the rollout engine is awake, and back after it sleeps; null = on with CUDA and "
        "rollout.engine vllm/sglang. Not with the hf engine (it generates with these weights)")

    def offloads_during_rollout(self, engine: str, on_gpu: bool) -> bool:
        """`offload_during_rollout` resolved (FSDP2 and the memory plan): null means on with CUDA and an engine
        that holds its own weights."""
        if self.offload_during_rollout is not None:
            return bool(self.offload_during_rollout)
        return on_gpu and engine in ("vllm", "sglang")


@dataclass
class DeepSpeedConfig:
    """train.strategy=deepspeed: DeepSpeed ZeRO (needs the `deepspeed` extra)."""

    zero_stage: int = option(3, "2: shard gradients and optimizer state; 3: shard the weights too", minimum=2, maximum=3)
    offload_optimizer: bool = option(False, "keep optimizer state (and its step) in host memory")
    offload_param: bool = option(False, "ZeRO-3 only: keep the weight shards in host memory between uses")


@dataclass
class TrainConfig:
    """Optimisation, batching, checkpoints and evaluation."""

    output_dir: str = option("runs/vlrft", "folder for checkpoints, metrics, completions and the saved config")
    total_steps: int = option(100, "training steps (one rollout batch and its updates each); 0 = none (only the "
                              "evaluation before training, if any)", minimum=0)
    seed: int = option(42, "seed of data order, sampling and initialisation", minimum=0, maximum=2**31 - 1)
    lr: float = option(1e-6, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_betas: list[float] = option(help="AdamW betas", factory=lambda: [0.9, 0.999])
    lr_scheduler: Literal["constant", "cosine", "linear"] = option(
        "constant", "learning-rate schedule after warm-up (cosine and linear decay to 0 at total_steps)")
    warmup_steps: int = option(0, "optimizer steps of linear learning-rate warm-up", minimum=0)
    max_grad_norm: float = option(1.0, "clip the global gradient norm to this")
    ppo_epochs: int = option(1, "passes over each rollout batch", minimum=1)
    global_mini_batch_completions: int | None = option(
        None, "completions per optimizer step over all ranks; default: the whole rollout batch (one update per "
        "epoch); was train.mini_batch_size", minimum=1)
    micro_batch_completions_per_rank: int = option(
        4, "completions per forward/backward pass on each rank (gradients accumulate up to the mini-batch); "
        "was train.micro_batch_size", minimum=1)
    max_tokens_per_micro_batch: int = option(
        0, "> 0: form each rank's micro-batches by this token budget instead of a row count, for natural-length "
        "completions: a forward processes at most this many token positions (each distinct prompt once + its "
        "completions, padded per class of similar length; a single longer row runs alone) and a prompt's rows stay "
        "together (docs/design.md); 0 = off, use micro_batch_completions_per_rank", minimum=0)
    skip_zero_advantage_rows: bool = option(
        True, "leave out of the policy's forward/backward the rows whose loss is exactly 0: advantage 0 at every "
        "token (a group whose rewards are all equal, under GRPO/RLOO) when nothing else trains on them (no KL in "
        "the loss, entropy_coef 0, no critic, policy_loss ppo/gspo or cpgd without drift, no "
        "high_entropy_token_frac); the loss denominators still count them, so the update is the same. "
        "actor/* statistics then cover the rows trained; actor/zero_advantage_rows_skipped is the share left out")
    strategy: Literal["single", "ddp", "fsdp2", "deepspeed"] = option(
        "single", "'single' process; 'ddp' (replicated), 'fsdp2' (sharded) or 'deepspeed' (ZeRO) under torchrun")
    dist_timeout_minutes: float = option(
        30.0, "how long a rank waits in a collective (NCCL and gloo) for the slowest rank before the run fails "
        "with a timeout: raise it when one rank legitimately works alone for longer (rank 0 converting a large "
        "DeepSpeed checkpoint to the universal format, or writing and syncing a 72B checkpoint to a slow shared "
        "disk); torch's own default is 10 min for NCCL")
    fsdp: FSDPConfig = option(help="options of train.strategy=fsdp2", factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = option(help="options of train.strategy=deepspeed (ZeRO-2/3)", factory=DeepSpeedConfig)
    save_every: int = option(20, "save a checkpoint every this many steps; 0 = only at the end (a crash then "
                             "loses every step)", minimum=0)
    keep_last: int = option(2, "keep this many newest checkpoints of this run (0 = keep all); older ones of the "
                            "same run are deleted (never another run's)", minimum=0)
    save_hf_model: Literal["every", "last"] = option(
        "every", "which checkpoints get model/ (the policy in Hugging Face format): 'every', or only the 'last' one "
        "(the end of training). FSDP2 and DeepSpeed resume from their own files; rank 0 writes model/ alone, in "
        "train.hf_model_dtype (144 GB for a 72B policy in bfloat16, while every GPU waits). single/ddp always write "
        "it (it is their weights)")
    hf_model_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "dtype of the weights in model/ under fsdp2/deepspeed, where model/ is an export (they resume from "
        "their own float32 files): 'auto' = model.dtype (bfloat16 by default: half the bytes of float32). single/ddp "
        "write float32 (model/ is what they resume from); only 'auto' or 'float32' there")
    resume: str = option("none", "'none', 'auto' (the last checkpoint written in output_dir) or a checkpoint path")
    resume_fallback: bool = option(
        False, "with train.resume=auto, a damaged newest checkpoint (a file missing, truncated or changed since the "
        "save, by its manifest.json) is named in one line and skipped for the newest complete one before it; "
        "without it such a run is refused")
    overwrite: bool = option(False, "start over in a non-empty output_dir, deleting the run files there; without "
                             "it (or resume) a non-empty output_dir is refused")
    save_on_interrupt: bool = option(True, "Ctrl-C or SIGTERM (a scheduler's preemption notice; torchrun forwards "
                                     "it to every worker) finishes the current step, saves a checkpoint, then "
                                     "stops; a second signal stops at once")
    eval_every: int = option(0, "evaluate every this many steps; 0 = no periodic evaluation", minimum=0)
    eval_before_training: bool = option(True, "evaluate once before the first step")
    eval_n: int = option(1, "samples per eval prompt (pass@k uses them)", minimum=1)
    eval_temperature: float = option(0.0, "eval sampling temperature; 0 = greedy")
    eval_batch_prompts: int = option(32, "prompts per evaluation generate call; was train.eval_batch_size", minimum=1)
    eval_accuracy_reward: str | None = option(None, "reward function whose value > 0.5 means correct; default: "
                                              "the first")

    # Old names, for code written against them (config files using them get a warning; DEPRECATED_KEYS).
    @property
    def mini_batch_size(self) -> int | None:
        return self.global_mini_batch_completions

    @property
    def micro_batch_size(self) -> int:
        return self.micro_batch_completions_per_rank

    @property
    def eval_batch_size(self) -> int:
        return self.eval_batch_prompts


@dataclass
class LoggingConfig:
    """Where metrics and sample completions go."""

    tensorboard: bool = option(True, "write TensorBoard event files under output_dir")
    wandb: bool = option(False, "log to Weights & Biases (needs the wandb package)")
    wandb_project: str = option("vlrft", "W&B project")
    wandb_run_name: str | None = option(None, "W&B run name; default: W&B's")
    wandb_api_key: str | None = option(None, "W&B API key; prefer the WANDB_API_KEY variable (never saved)",
                                       secret=True)
    log_every: int = option(1, "log metrics every this many steps", minimum=1)
    completions_every: int = option(10, "steps between completion tables; 0 = never", minimum=0)
    completions_rows: int = option(8, "completions shown per table", minimum=1)
    progress: bool = option(True, "show a progress bar on the terminal")


@dataclass
class Config:
    model: ModelConfig = option(help="the policy and the models derived from it", factory=ModelConfig)
    data: DataConfig = option(help="training and evaluation data", factory=DataConfig)
    rollout: RolloutConfig = option(help="sampling completions", factory=RolloutConfig)
    reward: RewardConfig = option(help="reward functions", factory=RewardConfig)
    algorithm: AlgorithmConfig = option(help="advantages, losses, KL and reward shaping", factory=AlgorithmConfig)
    train: TrainConfig = option(help="optimisation, batching, checkpoints and evaluation", factory=TrainConfig)
    logging: LoggingConfig = option(help="metrics and completion tables", factory=LoggingConfig)

    @property
    def prompts_per_step(self) -> int:
        return self.rollout.global_batch_completions // self.rollout.n

    def validate(self, world_size: int | None = None, per_node: int | None = None) -> "Config":
        """Check values against each other and resolve plug-in names; raises `ConfigError` naming the first problem.

        `world_size` and `per_node` (processes per node): as torchrun sets them (WORLD_SIZE, LOCAL_WORLD_SIZE) when
        not given; `per_node` defaults to the whole world when neither is known (one node)."""
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        validate_numbers(self)
        r, t = self.rollout, self.train
        _positive("rollout.n", r.n)
        _positive("rollout.global_batch_completions", r.global_batch_completions)
        _positive("rollout.max_new_tokens", r.max_new_tokens)
        r.validate_tools()
        _positive("train.micro_batch_completions_per_rank", t.micro_batch_completions_per_rank)
        if t.max_tokens_per_micro_batch < 0:
            _fail("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch,
                  "0 (off: micro-batches of micro_batch_completions_per_rank rows) or a positive token budget")
        _positive("train.ppo_epochs", t.ppo_epochs)
        _positive("data.max_prompt_length", self.data.max_prompt_length)
        self._validate_data()
        self._validate_engine(world, per_node)
        if r.global_batch_completions % r.n:
            _fail("rollout.global_batch_completions", r.global_batch_completions,
                  f"a multiple of rollout.n={r.n} (each prompt's group of {r.n} completions stays whole)")
        if self.prompts_per_step % world:
            _fail("rollout.global_batch_completions", r.global_batch_completions,
                  f"a multiple of rollout.n * world_size = {r.n * world} so every one of the {world} ranks gets whole groups")
        if t.strategy in ("single", "ddp") and t.hf_model_dtype not in ("auto", "float32"):
            _fail("train.hf_model_dtype", t.hf_model_dtype, f"'auto' or 'float32' with train.strategy={t.strategy} "
                  "(its model/ is the weights a resume starts from; fsdp2/deepspeed export it in another dtype)")
        mini = t.global_mini_batch_completions
        if mini is not None:
            _positive("train.global_mini_batch_completions", mini)
            if r.global_batch_completions % mini:
                _fail("train.global_mini_batch_completions", mini,
                      f"a divisor of rollout.global_batch_completions={r.global_batch_completions}")
            if mini % world:
                _fail("train.global_mini_batch_completions", mini, f"a multiple of world_size={world}")
        self._validate_algorithm()
        if t.lr <= 0:
            _fail("train.lr", t.lr, "a number > 0")
        if len(t.adam_betas) != 2:
            _fail("train.adam_betas", t.adam_betas, "two numbers, e.g. [0.9, 0.999]")
        if t.resume not in ("none", "auto") and not Path(t.resume).exists():
            _fail("train.resume", t.resume, "'none', 'auto' or the path of an existing checkpoint folder")
        if t.strategy == "single" and world > 1:
            _fail("train.strategy", t.strategy, f"'ddp', 'fsdp2' or 'deepspeed' when running {world} processes")
        self.reward.validate()
        if t.fsdp.offload_during_rollout and r.engine == "hf":
            _fail("train.fsdp.offload_during_rollout", True, "false or null with rollout.engine=hf (the hf engine "
                  "generates with the trainer's weights, which must stay on the GPU)")
        if t.deepspeed.zero_stage not in (2, 3):
            _fail("train.deepspeed.zero_stage", t.deepspeed.zero_stage, "2 or 3")
        if t.deepspeed.offload_param and t.deepspeed.zero_stage != 3:
            _fail("train.deepspeed.offload_param", True, "false with zero_stage=2 (only ZeRO-3 shards the weights)")
        return self

    def _validate_data(self) -> None:
        """The data section: pixel bounds, frame sampling, aspect ratio."""
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

    def _validate_engine(self, world: int, per_node: int | None) -> None:
        """vLLM / SGLang: memory share, sync buckets, and tensor-parallel groups that fit the processes and nodes."""
        r = self.rollout
        if r.engine != "vllm_server" and r.max_staleness:
            _fail("rollout.max_staleness", r.max_staleness, "0 unless rollout.engine=vllm_server (colocated engines "
                  "share the trainer's devices and sample synchronously)")
        if r.engine == "hf":
            return
        if r.engine == "vllm_server":
            if not r.server_urls:
                _fail("rollout.server_urls", r.server_urls, "the vLLM servers' URLs, e.g. [http://127.0.0.1:8000] "
                      "(`vlrft serve-command` prints the command that starts one)")
            if r.server_timeout_s <= 0:
                _fail("rollout.server_timeout_s", r.server_timeout_s, "a number of seconds > 0")
            _positive("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb)
            return
        if not 0 < r.gpu_memory_utilization <= 1:
            _fail("rollout.gpu_memory_utilization", r.gpu_memory_utilization, "a fraction in (0, 1]")
        _positive("rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb)
        _positive("rollout.tensor_parallel_size", r.tensor_parallel_size)
        if world % r.tensor_parallel_size:
            _fail("rollout.tensor_parallel_size", r.tensor_parallel_size,
                  f"a divisor of the number of processes ({world}); each group of that many ranks shares one engine")
        if per_node is None:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: processes on this node
        if per_node % r.tensor_parallel_size:
            _fail("rollout.tensor_parallel_size", r.tensor_parallel_size,
                  f"a divisor of the processes per node ({per_node}): an engine's group of ranks must stay on "
                  "one node (torchrun numbers a node's ranks consecutively)")

    def _validate_algorithm(self) -> None:
        """The algorithm section: clip ranges, estimator names and the numbers each estimator needs."""
        r, a = self.rollout, self.algorithm
        if not 0 <= a.clip_eps_low < 1:
            _fail("algorithm.clip_eps_low", a.clip_eps_low, "a number in [0, 1)")
        if a.clip_eps_high < 0:
            _fail("algorithm.clip_eps_high", a.clip_eps_high, "a number >= 0")
        if a.dual_clip is not None and a.dual_clip <= 1:
            _fail("algorithm.dual_clip", a.dual_clip, "a number > 1 (e.g. 3.0) or null to disable")
        if a.kl_coef < 0:
            _fail("algorithm.kl_coef", a.kl_coef, "a number >= 0")
        ADVANTAGES.is_known(a.advantage)
        POLICY_LOSSES.is_known(a.policy_loss)
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
            ("kl_k3_clamp", a.kl_k3_clamp is None or a.kl_k3_clamp > 0, "a number > 0 (default 10) or null for no clamp"),
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


# (key, test, what is allowed) for numbers whose range no other check covers; every float must also be finite.
_NUMBER_RANGES: tuple[tuple[str, typing.Callable[[Any], bool], str], ...] = (
    ("train.lr", lambda v: v > 0, "a number > 0, e.g. 1e-6"),
    ("train.weight_decay", lambda v: v >= 0, "a number >= 0"),
    ("train.max_grad_norm", lambda v: v >= 0, "a number >= 0 (0 turns clipping off)"),
    ("train.eval_temperature", lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    ("train.dist_timeout_minutes", lambda v: v > 0, "a number of minutes > 0, e.g. 30"),
    ("rollout.temperature", lambda v: v >= 0,
     "a number >= 0 (0 = greedy, which makes every completion of a group the same)"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "a fraction in (0, 1] (1 = off)"),
    ("rollout.min_p", lambda v: 0 <= v <= 1, "a fraction in [0, 1] (0 = off)"),
    ("rollout.repetition_penalty", lambda v: v > 0, "a number > 0 (1 = off)"),
    ("model.lora.dropout", lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
    ("algorithm.entropy_coef", lambda v: v >= 0, "a number >= 0"),
    ("algorithm.value_coef", lambda v: v >= 0, "a number >= 0"),
    ("algorithm.overlong_penalty", lambda v: v >= 0, "a number >= 0"),
    ("reward.timeout_s", lambda v: v > 0, "a number of seconds > 0"),
    ("reward.grader_timeout_s", lambda v: v > 0, "a number of seconds > 0"),
)


def _non_finite_numbers(obj: Any, prefix: str) -> typing.Iterator[tuple[str, float]]:
    """(key, value) of every NaN/inf float in a dataclass tree (lists and mappings included)."""
    import math

    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _non_finite_numbers(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from _non_finite_numbers(item, f"{prefix}[{i}]")
    elif isinstance(obj, dict):  # reward recipes; free-form kwargs (values of any type) are the callee's to check
        for key, item in obj.items():
            if isinstance(item, list) or dataclasses.is_dataclass(item):
                yield from _non_finite_numbers(item, f"{prefix}.{key}")
    elif isinstance(obj, float) and not math.isfinite(obj):
        yield prefix, obj


def range_text(bounds: tuple[int | None, int | None]) -> str:
    """An integer range in words: 'a positive integer', 'an integer >= 0', 'an integer in [2, 3]'."""
    lo, hi = bounds
    if hi is not None:
        return f"an integer in [{lo}, {hi}]" if lo is not None else f"an integer <= {hi}"
    return "a positive integer" if lo == 1 else f"an integer >= {lo}"


def declared_ranges(obj: Any, prefix: str = "") -> typing.Iterator[tuple[str, Any, tuple[int | None, int | None]]]:
    """(key, value, (minimum, maximum)) of every option declared with a range in a dataclass tree (list items each)."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from declared_ranges(value, key)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from declared_ranges(item, f"{key}[{i}]")
        elif "range" in f.metadata:
            if isinstance(value, list):
                for i, item in enumerate(value):
                    yield f"{key}[{i}]", item, f.metadata["range"]
            elif value is not None:
                yield key, value, f.metadata["range"]


def validate_numbers(cfg: "Config") -> None:
    """Every float finite (a NaN learning rate or temperature trains garbage silently), every integer in its
    declared range, and the other ranges respected."""
    for key, value in _non_finite_numbers(cfg, ""):
        _fail(key, value, "a finite number (not nan or inf)")
    for key, value, (lo, hi) in declared_ranges(cfg):
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            _fail(key, value, range_text((lo, hi)))
    for key, ok, allowed in _NUMBER_RANGES:
        section, *rest = key.split(".")
        value = getattr(cfg, section)
        for name in rest:
            value = getattr(value, name)
        if not ok(value):
            _fail(key, value, allowed)
    for i, beta in enumerate(cfg.train.adam_betas):
        if not 0 <= beta < 1:
            _fail(f"train.adam_betas[{i}]", beta, "a number in [0, 1), e.g. [0.9, 0.999]")


def _fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"config: {key}={value!r} is not allowed; expected {allowed}")




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


# Old key -> new key. Batch sizes now say what they count and over which ranks; the old keys still
# load, with a warning naming the new one.
DEPRECATED_KEYS: dict[str, str] = {
    "rollout.batch_size": "rollout.global_batch_completions",
    "train.mini_batch_size": "train.global_mini_batch_completions",
    "train.micro_batch_size": "train.micro_batch_completions_per_rank",
    "train.eval_batch_size": "train.eval_batch_prompts",
}
_warned: set[str] = set()


def rename_deprecated(data: dict, prefix: str = "") -> dict:
    """A copy of the mapping at `prefix` (recursively for the top level) with deprecated keys renamed.

    Prints one warning per old key per process; giving both the old and the new key is an error.
    """
    out = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if full in DEPRECATED_KEYS:
            new_full = DEPRECATED_KEYS[full]
            new_key = new_full.rsplit(".", 1)[1]
            if new_key in data:
                raise ConfigError(f"config: both '{full}' and '{new_full}' are set; keep only '{new_full}' "
                                  f"('{full}' is its deprecated name)")
            if full not in _warned and os.environ.get("RANK", "0") == "0":
                _warned.add(full)
                print(f"vlrft: config key '{full}' is deprecated; use '{new_full}' ({_help_of(new_full)})",
                      file=sys.stderr)
            key = new_key
        elif not prefix and isinstance(value, dict):
            value = rename_deprecated(value, full)
        out[key] = value
    return out


def _help_of(key: str) -> str:
    section, name = key.split(".", 1)
    owner = typing.get_type_hints(Config)[section]
    return next(f.metadata.get("help", "") for f in dataclasses.fields(owner) if f.name == name)


def build_dataclass(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, naming the full key of any unknown or mistyped entry."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    if cls is Config or any(old.startswith(f"{prefix}.") for old in DEPRECATED_KEYS):
        data = rename_deprecated(data, prefix)
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


def _strict_loader():
    """A YAML SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently: a second
    `train:` block would replace the first whole), naming both lines."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict[tuple[str, str], int] = {}
                for key_node, _ in node.value:  # before `<<: *anchor` merges (keys written after one override it)
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                    if key in seen:
                        raise _DuplicateKey(key_node.value, seen[key], line)
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, second: int):
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


def _read_yaml(path: Path, shown: str) -> Any:
    """The YAML file's contents; every way it can be unreadable is one `ConfigError` naming the file and where."""
    import yaml

    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"config file '{shown}' is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at line {line}); "
                          "save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file '{shown}' cannot be read: {exc.strerror or exc}") from None
    try:
        raw = yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        raise ConfigError(f"config file '{shown}': key '{dup.key}' is given twice in one mapping (lines {dup.first} "
                          f"and {dup.second}); the second would silently replace the first. Merge them into one") \
            from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file '{shown}' is not valid YAML{where}: {problem}; fix the file") from None
    except RecursionError:
        raise ConfigError(f"config file '{shown}' is nested too deeply to read; fix the file") from None
    cycle = _cycle_in(raw, "")
    if cycle is not None:
        raise ConfigError(f"config file '{shown}': '{cycle}' refers to a value that contains it (a YAML anchor used "
                          "inside its own value, e.g. `a: &x [*x]`); write the value out instead") from None
    return raw


def _cycle_in(value: Any, key: str, path: tuple[int, ...] = (), clean: set[int] | None = None) -> str | None:
    """The key of the first mapping or list that contains itself (a self-referencing YAML anchor), or None.

    `clean`: containers already walked without finding one (an anchor used many times is walked once)."""
    clean = set() if clean is None else clean
    if not isinstance(value, (dict, list)) or id(value) in clean:
        return None
    if id(value) in path:
        return key
    path = (*path, id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for k, item in items:
        found = _cycle_in(item, f"{key}.{k}" if key else str(k), path, clean)
        if found is not None:
            return found
    clean.add(id(value))
    return None


def _parse_value(item: str) -> Any:
    """The value of one `key=value` override, read as OmegaConf reads a dotlist value (YAML: numbers, lists, ...)."""
    from omegaconf import OmegaConf

    _, _, text = item.partition("=")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]), resolve=False)["v"]
    except Exception as exc:
        raise ConfigError(f"config: could not parse override '{item}': {' '.join(str(exc).split())[:200]}") from None


def _override_key(key: str) -> list[str]:
    """The parts of an override's dotted key, a deprecated `section.key` renamed (so an old-name override still
    overrides the file's new-name key); `a[0].b` is taken as `a.0.b`."""
    parts = [p for p in key.replace("[", ".").replace("]", "").split(".")]
    if any(not p for p in parts):
        raise ConfigError(f"config: override key '{key}' has an empty part; write it as section.key=value")
    head = ".".join(parts[:2])
    if head in DEPRECATED_KEYS:
        rename_deprecated({parts[0]: {parts[1]: None}})  # the warning, once
        parts[:2] = DEPRECATED_KEYS[head].split(".")
    return parts


def _merged(old: Any, new: Any) -> Any:
    """A mapping given as an override merges into the one there (as OmegaConf.merge does); anything else replaces."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = dict(old)
        for k, v in new.items():
            out[k] = _merged(out.get(k), v)
        return out
    return new


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`data` with each `section.key=value` applied; a number indexes a list (`reward.functions.0.weight=2`,
    `data.train_files.0=x`). Each problem is one `ConfigError` naming the override."""
    import copy

    given = {item.partition("=")[0].strip() for item in overrides}
    for old, new in DEPRECATED_KEYS.items():
        if old in given and new in given:
            raise ConfigError(f"config: both '{old}' and '{new}' are set; keep only '{new}' ('{old}' is its "
                              "deprecated name)")
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"config: override '{item}' is not of the form section.key=value (e.g. train.lr=1e-6)")
        key = item.partition("=")[0].strip()
        parts, value = _override_key(key), _parse_value(item)
        node: Any = out
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "the top level"
            if isinstance(node, list):
                if not part.lstrip("-").isdigit():
                    raise ConfigError(f"config: override '{item}': '{where}' is a list; index it by number "
                                      f"({where}.0.{'.'.join(parts[depth:])}=...) or give the whole list "
                                      f"({where}=[...])")
                index = int(part)
                if not 0 <= index < len(node):
                    raise ConfigError(f"config: override '{item}': '{where}' has {len(node)} entries (0 to "
                                      f"{len(node) - 1}), so there is no entry {index}; give the whole list "
                                      f"({where}=[...]) to add entries")
                if last:
                    node[index] = _merged(node[index], value)
                else:
                    if node[index] is None:
                        node[index] = {}
                    node = node[index]
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"config: override '{item}': '{where}' is {node!r}, not a mapping or list, so "
                                  f"'{part}' cannot be set inside it")
            if last:
                node[part] = _merged(node.get(part), value)
            else:
                if node.get(part) is None:  # not in the file: a list's default is what an index points into
                    default = _default_at(parts[:depth + 1])
                    node[part] = copy.deepcopy(default) if isinstance(default, list) else {}
                node = node[part]
    return out


def _default_at(parts: list[str]) -> Any:
    """The default value at a dotted key of Config (None where there is none, e.g. inside a list or a mapping)."""
    value: Any = to_dict(Config())
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None,
                validate: bool = True) -> Config:
    """Load a YAML config (or defaults when `path` is None), apply `section.key=value` overrides, validate."""
    from omegaconf import OmegaConf

    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' not found; pass the path of a YAML file such as configs/demo.yaml")
        raw = _read_yaml(p, str(path))
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections (model:, data:, ...), not "
                              f"{type(raw).__name__}")
        raw = rename_deprecated(raw)
    if overrides:
        raw = apply_overrides(raw, list(overrides))
    try:
        data = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    except RecursionError:
        raise ConfigError("config: an interpolation ${...} refers to itself; fix it") from None
    except Exception as exc:
        text = " ".join(str(exc).split())[:300]
        raise ConfigError(f"config: could not resolve interpolations: {text}") from None
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

"""`Config`: the whole run, one field per section, and `Config.validate`, the checks that read several sections."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vlrft.config.algorithm import AlgorithmConfig
from vlrft.config.checks import _fail, _positive, validate_numbers
from vlrft.config.data import DataConfig
from vlrft.config.logging import LoggingConfig
from vlrft.config.model import ModelConfig
from vlrft.config.options import option
from vlrft.config.reward import RewardConfig
from vlrft.config.rollout import RolloutConfig
from vlrft.config.train import TrainConfig
from vlrft.registry import ADVANTAGES, POLICY_LOSSES

# The largest group: a prompt's completions are sampled together on one rank, and no advantage estimator needs more
# siblings than this (GRPO/RLOO statistics settle long before); a larger n is a typo (10**30 overflowed in decoding).
MAX_GROUP = 4096
# The most tokens one rank may hold for a step (its completions * (prompt + tokens after it)): 2**30 tokens are
# 24 GiB of per-token tensors alone (ids, masks, old and reference logprobs; >= 24 bytes a token) before any model
# state or KV cache, and ~30x the largest real step (1024 completions of 32k tokens per GPU).
MAX_TOKENS_PER_RANK = 2**30


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
        _positive("data.max_prompt_length", self.data.max_prompt_length)
        self._validate_sizes(world)
        _positive("train.micro_batch_completions_per_rank", t.micro_batch_completions_per_rank)
        if t.max_tokens_per_micro_batch < 0:
            _fail("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch,
                  "0 (off: micro-batches of micro_batch_completions_per_rank rows) or a positive token budget")
        _positive("train.ppo_epochs", t.ppo_epochs)
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

    def _validate_sizes(self, world: int) -> None:
        """What one rank must hold for a step, bounded before anything is allocated (a huge n or batch would
        otherwise overflow in decoding or ask the allocator for tens of GB)."""
        r = self.rollout
        if r.n > MAX_GROUP:
            _fail("rollout.n", r.n, f"at most {MAX_GROUP} completions per prompt (a group is sampled on one rank; "
                  "advantages need far fewer siblings, typically 4-64)")
        rows = -(-r.global_batch_completions // max(world, 1))
        row_tokens = self.data.max_prompt_length + r.tokens_after_prompt
        if rows * row_tokens > MAX_TOKENS_PER_RANK:
            after = "rollout.max_trajectory_tokens" if r.tools else "rollout.max_new_tokens"
            _fail("rollout.global_batch_completions", r.global_batch_completions,
                  f"at most {MAX_TOKENS_PER_RANK:,} tokens per rank per step; {rows:,} completions per rank "
                  f"(over {world} rank(s)) * {row_tokens:,} tokens (data.max_prompt_length + {after}) = "
                  f"{rows * row_tokens:,}, more than any GPU holds: lower rollout.global_batch_completions, "
                  f"the token lengths, or add ranks")

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

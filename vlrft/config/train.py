"""The `train:` section: strategy (with its `fsdp:` and `deepspeed:` options), optimisation, batching,
checkpoints and evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlrft.config.options import option


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
        "the loss, entropy_coef 0, router_aux_loss_coef 0, no critic, policy_loss ppo/gspo or cpgd without drift, no "
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


"""The SPMD trainer: one process per device (or one in all), the same code path for both.

One step (docs/design.md, "One step"): collect prompts -> rollouts -> rewards (`collect`), old/ref logprobs and
advantages (`make_experience`), PPO epochs over mini/micro-batches (`update`), weights to the
engine, metrics reduced over ranks, then evaluation and checkpoints when due.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import torch

from vlrft.algo import RunningMoments, Stats, make_kl_controller
from vlrft.config import Config, save_config
from vlrft.data import PromptEncoder, PromptSampler
from vlrft.parallel import make_strategy
from vlrft.parallel.strategy import ModelSource, Strategy, TrainedModel
from vlrft.errors import UserError
from vlrft.logging import RunLogger
from vlrft.models import precision, router_loss
from vlrft.models.actor import ActorVL, CriticVL, apply_lora, freeze_vision
from vlrft.models.loading import DTYPES, load_processor, model_fingerprint
from vlrft.models.recipes import ensure_model
from vlrft.plan import check_fits_at_load, host_memory_warning, node_memory_bytes
from vlrft.rollout import make_engine
from vlrft.rollout.base import EngineDeps, SamplingParams, engine_state, load_engine_state, sync_metrics
from vlrft.tokens import TokenSpec
from vlrft.trainer import checkpoint as ckpt
from vlrft.trainer import run_folder
from vlrft.trainer.collect import Collected, CollectDeps
from vlrft.trainer.evaluate import EvalDeps, accuracy_reward_key, evaluate
from vlrft.trainer.experience import Batching, Experience, ExperienceDeps, PhaseTimer, make_experience
from vlrft.trainer.interrupt import InterruptGuard, TrainingInterrupted
from vlrft.trainer.micro_batches import share_every_forward
from vlrft.trainer.out_of_memory import explain_out_of_memory, sampling_fixes, training_fixes
from vlrft.trainer.producer import make_producer, staleness_metrics
from vlrft.trainer.step_report import completion_rows, step_metrics
from vlrft.trainer.training_data import read_training_data
from vlrft.trainer.update import UpdateDeps, skips_zero_advantage_rows, update


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(params: list[torch.nn.Parameter], train_cfg) -> torch.optim.Optimizer:
    """AdamW, fused into one kernel per step where torch supports it for these parameters (CPU and CUDA)."""
    options = dict(lr=train_cfg.lr, betas=tuple(train_cfg.adam_betas), weight_decay=train_cfg.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **options)
    except (RuntimeError, TypeError):  # e.g. a device or dtype without the fused kernel
        return torch.optim.AdamW(params, **options)


class Trainer:
    """Builds everything a run needs from a `Config`; `fit()` trains, evaluates and checkpoints."""

    def __init__(self, cfg: Config, strategy: Strategy | None = None, evaluate_only: bool = False):
        """`evaluate_only`: for `vlrft eval`, which writes nothing into train.output_dir (no folder checks)."""
        self.cfg = cfg
        self.evaluate_only = evaluate_only
        self.producer = None  # where steps' rollouts come from (`rollout_producer`)
        self._resume_state: dict | None = None  # the sampler and engine as after the last trained step's collection
        self.strategy = strategy or make_strategy(cfg.train.strategy, cfg)
        self.device = self.strategy.device
        world, rank = self.strategy.world_size, self.strategy.rank
        cfg.validate(world)
        seed_everything(cfg.train.seed + rank)
        self.output_dir = Path(cfg.train.output_dir)
        # One live run per folder: rank 0 holds it (run_folder.RunHold) before it reads or clears anything there.
        self.hold = run_folder.RunHold(self.output_dir, self.message) if self.strategy.is_main and not evaluate_only \
            else None
        if not evaluate_only:
            self._main_decides(self.hold.acquire if self.hold is not None else None)
        try:
            self._build(evaluate_only)
        except BaseException:
            self.release_hold()
            raise

    def release_hold(self) -> None:
        """Give the output folder back (end of fit, or a run that stopped before it)."""
        if self.hold is not None:
            self.hold.release()

    def _decide_run_folder(self, evaluate_only: bool) -> dict:
        """The checkpoint to resume (`self.resume_from`), the run id and the old run's files; returns the checkpoint's
        trainer state, read once ({} when none), after checking this strategy can resume it."""
        cfg = self.cfg
        # Rank 0 decides what the folder holds (resume=auto lists it; another run's files are refused) and every rank
        # follows: on node-local disks the others would each decide from their own disk, then `check_shared` refuses.
        self.resume_from = None if evaluate_only else self._main_decides(lambda: ckpt.checkpoint_to_resume(
            cfg.train.resume, self.output_dir, cfg.train.resume_fallback, self.message))
        # Refused before anything is loaded; the old run's files are cleared (overwrite) only when training starts.
        self._stale_run_files = [] if evaluate_only else self._main_decides(lambda: run_folder.check_output_dir(
            self.output_dir, cfg.train.resume, self.resume_from, cfg.train.overwrite))
        self.run_id = self._main_decides(lambda: ckpt.load_trainer_state(self.resume_from).get("run_id")
                                         if self.resume_from else run_folder.new_run_id())
        if not evaluate_only:
            run_folder.check_shared(self.strategy, self.output_dir, self.run_id)
        resumed: dict = {}  # the checkpoint's trainer state, read once
        if self.resume_from is not None:
            self._every_rank_sees(self.resume_from / ckpt.STATE_FILE, f"train.resume: checkpoint {self.resume_from}")
            resumed = ckpt.load_trainer_state(self.resume_from)
            # before any model loads (minutes for a large one): a checkpoint this strategy cannot resume
            self.strategy.check_resumable(self.resume_from, resumed.get("world_size", 1))
        return resumed

    def _prepare_base_model(self, resumed: dict) -> None:
        """model.path built by its recipe where it does not exist yet, and fingerprinted: a resumed checkpoint must
        have been trained from the same base."""
        cfg = self.cfg
        if cfg.model.build_recipe:
            if self.strategy.is_main and not (Path(cfg.model.path) / "config.json").is_file():
                self.message(f"{cfg.model.path} does not exist yet: building it with recipe '{cfg.model.build_recipe}'")
                ensure_model(cfg.model.path, cfg.model.build_recipe)
            self.strategy.barrier()
            built = Path(cfg.model.path) / "config.json"
            self._every_rank_sees(built, f"model.path={cfg.model.path} (built by rank 0)")
        # A resume takes frozen weights (a LoRA base, a frozen vision tower), the reference, and under FSDP2/DeepSpeed the
        # starting point from model.path: it must be the base the checkpoint was trained from (a copy is fine).
        self.base_model = self._main_decides(lambda: model_fingerprint(cfg.model.path))
        if self.resume_from is not None:
            saved = resumed.get("base_model")
            if saved and self.base_model and saved != self.base_model:
                raise UserError(f"train.resume: checkpoint {self.resume_from} was trained from another base model than "
                                f"model.path={cfg.model.path} (their config or weight files differ); the resumed run "
                                "would take its frozen weights and reference from it. Point model.path at the same base")

    def _check_memory_plan(self, world: int) -> None:
        """On GPUs: stop here with one line when the plan says it cannot fit (for the data's most media in a prompt)."""
        cfg = self.cfg
        plan = check_fits_at_load(cfg, world, max((len(s.images) for s in self.train_samples), default=1),
                                  max((len(s.videos) for s in self.train_samples), default=0))
        warning = host_memory_warning(plan, node_memory_bytes()) if plan is not None else None
        if warning:  # printed by rank 0, whose node the plan's host figures are
            self.message(warning)

    def _build_models(self, evaluate_only: bool) -> None:
        """The processor, the policy (wrapped by the strategy, with its optimizer), its tokens, the reference, the
        critic and the scheduler."""
        cfg = self.cfg
        self.processor = load_processor(cfg.model.path, cfg.model.trust_remote_code)
        self.actor = self._build_actor()
        self.wrapped, self.optimizer = self.strategy.prepare_trainable(self.actor, self._make_optimizer)
        self.tokens = TokenSpec.from_model(self.processor, self.actor.model.config,
                                           getattr(self.actor.model, "generation_config", None),
                                           cfg.rollout.stop_token_ids)
        self.actor.suppressed_ids = self.tokens.suppressed_ids
        self.actor.sampling_truncation = self._sampling_truncation()
        self.ref = None if evaluate_only else self._build_ref()
        self.critic, self.critic_wrapped, self.critic_optimizer = (None, None, None) if evaluate_only else \
            self._build_critic()
        self.scheduler = self._build_scheduler()
        self.strategy.balance_vision_calls([self.actor, self.ref, self.critic])  # sharded: no rank skips the tower
        ranks_differ = cfg.train.max_tokens_per_micro_batch > 0 or skips_zero_advantage_rows(
            cfg.train.skip_zero_advantage_rows, cfg.algorithm, cfg.algorithm.kl_coef, has_critic=self.critic is not None)
        if ranks_differ and self.strategy.balances_vision_calls:
            share_every_forward([self.actor, self.ref, self.critic])  # ranks' micro-batches differ: same block calls

    def _build(self, evaluate_only: bool) -> None:
        cfg, world, rank = self.cfg, self.strategy.world_size, self.strategy.rank
        resumed = self._decide_run_folder(evaluate_only)
        self.step_count = 0
        self.phase_times = PhaseTimer()  # this step's seconds per phase (`timer`)
        if cfg.rollout.engine == "vllm_server":  # an unreachable server is named before anything loads
            from vlrft.rollout.server import ServerPool

            ServerPool(cfg.rollout.server_urls, cfg.rollout.server_timeout_s).check_reachable()
        # Data first (bad rows and media found before any model loads). `vlrft eval` needs only the eval data:
        # the training files are not read (they may not even exist there).
        self.train_samples = [] if evaluate_only else \
            self._read(cfg.data.train_files, cfg.data.max_train_samples, "data.train_files")
        self.eval_samples = (self._read(cfg.data.eval_files, cfg.data.max_eval_samples, "data.eval_files")
                             if cfg.data.eval_files else [])
        self._prepare_base_model(resumed)
        self._check_memory_plan(world)
        self._build_models(evaluate_only)
        self.encoder = PromptEncoder(self.processor, cfg.data, extra_eos_token_ids=cfg.rollout.stop_token_ids)
        self.prompts_per_rank = cfg.prompts_per_step // world
        self.mini_batch_per_rank = (cfg.train.global_mini_batch_completions
                                    or cfg.rollout.global_batch_completions) // world
        self.sampler = None if evaluate_only else PromptSampler(len(self.train_samples), cfg.prompts_per_step,
                                                                cfg.train.seed, cfg.data.shuffle, rank, world)
        self.rewards = self._build_rewards()
        self.rewards.prepare()  # a reward model loads now, not inside the first step's reward.timeout_s
        self.accuracy_key = accuracy_reward_key(cfg, self.rewards)
        self.sampling = SamplingParams.from_config(cfg.rollout)
        # What an out-of-memory error names as the way out, per phase (from the config alone: built once).
        self.sampling_memory_fixes = tuple(sampling_fixes(cfg, world))
        self.training_memory_fixes = tuple(training_fixes(cfg))
        self.train_temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        restores_weights = self.resume_from is not None and self.strategy.checkpoint_holds_weights
        self.engine = make_engine(cfg, EngineDeps(actor=self.actor, processor=self.processor, tokens=self.tokens,
                                                  strategy=self.strategy, prompts_per_rank=self.prompts_per_rank,
                                                  encoder=self.encoder, autocast=self.autocast,
                                                  sync_weights_at_start=not restores_weights))
        self.kl_controller = make_kl_controller(cfg.algorithm)
        self.reward_moments = RunningMoments()
        single_update = (cfg.train.ppo_epochs == 1
                         and self.mini_batch_per_rank * world == cfg.rollout.global_batch_completions)
        kl_shaped = cfg.algorithm.kl_in == "reward" and self.ref is not None
        self.needs_old_logprobs = not single_update or kl_shaped or self.critic is not None
        self.logger: RunLogger | None = None
        if self.resume_from is not None:
            if restores_weights:  # the optimizer state comes back to the GPUs: not beside an awake engine's KV cache
                self.engine.sleep()
            self._restore(self.resume_from, resumed)
            if restores_weights:  # the engine started from model.path: now it loads the restored weights
                self.engine.update_weights(self.actor)

    # ------------------------------------------------------------------ setup

    def _main_decides(self, decide):
        """`decide()` on the main rank; its result, or the `UserError` it raised, on every rank."""
        outcome = None
        if self.strategy.is_main:
            try:
                outcome = ("ok", decide())
            except UserError as exc:
                outcome = ("error", exc)
        kind, value = self.strategy.broadcast_object(outcome)
        if kind == "error":
            raise value
        return value

    def _every_rank_sees(self, path: Path, what: str) -> None:
        """Refuse to go on when some rank cannot see `path` (a node-local disk where a shared one was needed)."""
        missing = run_folder.ranks_without(self.strategy, run_folder.appears(path))
        if missing:
            raise UserError(f"{what}: {path} is not visible on {', '.join(missing)}; put it on a file system every "
                            "node mounts, or copy it to the same path on every node")

    def _read(self, files: list[str], limit: int | None, key: str) -> list:
        return read_training_data(files, limit, key, self.cfg, self.strategy, self.message,
                                  progress=self.cfg.logging.progress and self.strategy.is_main)

    def _build_actor(self) -> ActorVL:
        cfg = self.cfg.model
        lora = cfg.lora.rank > 0 and not self.evaluate_only  # evaluation runs the (merged) weights as they are
        # single/DDP: a checkpoint's model/ is the policy's weights. FSDP2/DeepSpeed restore them from their own files
        # (model/ is an export, perhaps not written): start from model.path, as the run did.
        from_export = self.resume_from is not None and not self.strategy.checkpoint_holds_weights
        weights = self.resume_from / "model" if from_export and not lora else cfg.path
        source = dataclasses.replace(self._source(weights, "float32"), adapters=lora)
        model = self.strategy.load_model(source, trainable=True)
        if cfg.freeze_vision_tower:
            freeze_vision(model)
        if lora:
            if from_export:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, self.resume_from / "model", is_trainable=True)
            else:
                model = apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules,
                                   exclude_vision=cfg.freeze_vision_tower)
        self._train_mode(model)
        router_loss.check_router_loss(model, self.cfg.algorithm.router_aux_loss_coef, lora)
        ids = (int(getattr(model.config, f"{kind}_token_id", -1) or -1) for kind in ("image", "video"))
        return ActorVL(model, *ids, router_aux_loss=self.cfg.algorithm.router_aux_loss_coef > 0)

    def _train_mode(self, model: torch.nn.Module) -> None:
        """A trained model (the policy, the critic): gradient checkpointing as configured, no KV cache kept by its
        forwards, training mode."""
        if self.cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()

    def _build_ref(self) -> ActorVL | None:
        if self.cfg.algorithm.kl_coef <= 0:
            return None  # no reference model when beta == 0
        cfg = self.cfg.model
        dtype = precision.dtype_name(precision.compute_dtype(self.device, cfg.dtype))
        model = self.strategy.load_model(self._source(cfg.ref_path or cfg.path, dtype), trainable=False).eval()
        model.requires_grad_(False)
        return self.strategy.prepare_frozen(ActorVL(model, self.actor.image_token_id, self.actor.video_token_id,
                                                    suppressed_ids=self.tokens.suppressed_ids))

    def _build_critic(self):
        if self.cfg.algorithm.advantage != "gae":
            return None, None, None
        cfg = self.cfg.model
        model = self.strategy.load_model(self._source(cfg.critic_path or cfg.path, "float32"), trainable=True)
        self._train_mode(model)  # as the policy: a whole second model's activations recomputed under checkpointing
        critic = CriticVL(model, self.actor.image_token_id, self.actor.video_token_id)
        critic.value_head.to(self.device)
        critic.train()
        wrapped, optimizer = self.strategy.prepare_trainable(critic, self._make_optimizer)
        return critic, wrapped, optimizer

    def _source(self, path, dtype: str) -> ModelSource:
        cfg = self.cfg.model
        return ModelSource(path, dtype, cfg.attn_implementation, cfg.trust_remote_code)

    def _make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return make_optimizer(params, self.cfg.train)

    def trained_parts(self) -> list[TrainedModel]:
        """What one optimizer step updates: the policy, then the critic (PPO)."""
        parts = [TrainedModel(self.wrapped, self.optimizer, self.scheduler)]
        if self.critic is not None:
            parts.append(TrainedModel(self.critic_wrapped, self.critic_optimizer))
        return parts

    def _build_scheduler(self):
        from transformers import get_scheduler

        cfg = self.cfg
        total = cfg.rollout.global_batch_completions
        updates_per_step = cfg.train.ppo_epochs * (total // (cfg.train.global_mini_batch_completions or total))
        return get_scheduler(cfg.train.lr_scheduler, self.optimizer,
                             num_warmup_steps=cfg.train.warmup_steps * updates_per_step,
                             num_training_steps=cfg.train.total_steps * updates_per_step)

    def _build_rewards(self):
        from vlrft.rewards import RewardSet

        return RewardSet.from_config(self.cfg.reward)

    # ------------------------------------------------------------------ helpers

    def sum_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.strategy.all_reduce(tensor, "sum")

    def max_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.strategy.all_reduce(tensor, "max")

    def autocast(self):
        """Generation's mixed precision (weight casts cached for all the decode steps)."""
        return precision.autocast(self.device, self.cfg.model.dtype)

    def _sampling_truncation(self):
        """The rollout's top-k / top-p / min-p for TIS (None without TIS or without truncation): the engines report
        the truncated distribution's logprobs, the trainer computes the full one's and the kept mass between them."""
        from vlrft.models.logprobs import SamplingTruncation

        r = self.cfg.rollout
        truncation = SamplingTruncation(top_k=max(0, r.top_k), top_p=r.top_p, min_p=r.min_p, engine=r.engine)
        # SGLang reports the untruncated distribution's logprobs (docs/engines.md): nothing to add back there
        truncated_logprobs = r.engine in ("hf", "vllm", "vllm_server")
        return truncation if self.cfg.algorithm.tis_cap is not None and truncation.active and truncated_logprobs \
            else None

    def forward_autocast(self):
        """The scoring and training forwards' mixed precision (`precision.forward_autocast`)."""
        return precision.forward_autocast(self.device, self.cfg.model.dtype, self.cfg.model.gradient_checkpointing)

    def timer(self, name: str):
        return self.phase_times(name)

    def message(self, text: str) -> None:
        if self.strategy.is_main:
            if getattr(self, "logger", None) is not None:
                self.logger.message(text)
            else:
                print(text, flush=True)

    # ------------------------------------------------------------------ what each phase needs

    def _batching(self) -> Batching:
        return Batching(self.tokens.pad_id, self.device, self.cfg.train.micro_batch_completions_per_rank,
                        self.forward_autocast, max_tokens=self.cfg.train.max_tokens_per_micro_batch,
                        share_prompts=self.actor.share_prompts, message=self.message,
                        split_widths=not self.strategy.balances_vision_calls,  # as ActorVL._width_classes
                        agree_count=self.max_count if self.strategy.world_size > 1 else None)

    def max_count(self, count: int) -> int:
        """The largest `count` over ranks (token-budget micro-batches: every rank runs as many forwards)."""
        return int(self.max_reduce(torch.tensor([count])).item())

    def _collect_deps(self) -> CollectDeps:
        return CollectDeps(algo=self.cfg.algorithm, rollout=self.cfg.rollout, prompts_per_rank=self.prompts_per_rank,
                           samples=self.train_samples, sampler=self.sampler, encoder=self.encoder, engine=self.engine,
                           sampling=self.sampling, rewards=self.rewards, strategy=self.strategy, timer=self.timer,
                           sampling_memory_fixes=self.sampling_memory_fixes)

    def _experience_deps(self) -> ExperienceDeps:
        return ExperienceDeps(algo=self.cfg.algorithm, group_size=self.cfg.rollout.n, batching=self._batching(),
                              temperature=self.train_temperature, kl_coef=self.kl_controller.value,
                              old_policy=self.actor if self.needs_old_logprobs else None, ref=self.ref,
                              critic=self.critic, reduce=self.sum_reduce, timer=self.timer)

    def _update_deps(self, step: int) -> UpdateDeps:
        watched = [p for p in self.actor.parameters() if p.requires_grad]
        if self.critic is not None:
            watched += list(self.critic.parameters())
        return UpdateDeps(algo=self.cfg.algorithm, strategy=self.strategy, batching=self._batching(),
                          policy=self.wrapped, trained_parts=self.trained_parts(), watched_params=watched,
                          ppo_epochs=self.cfg.train.ppo_epochs, mini_batch_per_rank=self.mini_batch_per_rank,
                          max_grad_norm=self.cfg.train.max_grad_norm, max_new_tokens=self.cfg.rollout.max_new_tokens,
                          temperature=self.train_temperature, kl_coef=self.kl_controller.value, step=step,
                          lr=self.cfg.train.lr, critic=self.critic_wrapped, message=self.message,
                          skip_zero_advantage_rows=self.cfg.train.skip_zero_advantage_rows,
                          memory_fixes=self.training_memory_fixes)

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy/pass@k/reward at `step` (see `vlrft.trainer.evaluate`)."""
        cfg = self.cfg
        sampling = SamplingParams.from_config(cfg.rollout, n=cfg.train.eval_n, temperature=cfg.train.eval_temperature)
        batch_fix = (f"lower train.eval_batch_prompts (now {cfg.train.eval_batch_prompts}, each sampled "
                     f"train.eval_n={cfg.train.eval_n} times)")
        out_of_memory = explain_out_of_memory(f"step {step}, evaluation",
                                              sampling_fixes(cfg, self.strategy.world_size, batch_fix))
        with out_of_memory, self.engine_awake():  # as for rollouts: a colocated engine's memory only beside offloaded state
            return evaluate(EvalDeps(samples=self.eval_samples, rank=self.strategy.rank,
                                     world_size=self.strategy.world_size, encoder=self.encoder, engine=self.engine,
                                     sampling=sampling, batch_prompts=cfg.train.eval_batch_prompts,
                                     rewards=self.rewards, accuracy_key=self.accuracy_key, reduce=self.sum_reduce,
                                     gather_objects=self.strategy.all_gather_object),
                            step)

    @contextlib.contextmanager
    def engine_awake(self):
        """The engine awake for sampling, asleep after; the trainer's state in host memory meanwhile where the
        strategy offloads it (fsdp2 with vLLM/SGLang)."""
        with self.strategy.offloaded_for_rollout(self.trained_parts(), [self.ref]):
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the update's freed blocks back before the engine takes its share
            self.engine.wake()
            yield
            self.engine.sleep()

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, float]:
        """One step, top-down; returns this step's metrics (reduced over ranks)."""
        step = self.step_count + 1
        self.phase_times.take()  # a fresh start
        start = time.perf_counter()
        waking = explain_out_of_memory(f"step {step}, handing the GPU between the trainer's state and the engine "
                                       f"(rollout.engine={self.cfg.rollout.engine})",
                                       self.sampling_memory_fixes)  # sampling's own errors are named inside collect
        with waking:  # 1. rollouts + rewards (refills keep whole, usable groups), collected now or ahead of time
            produced = self.rollout_producer().next(step)
        collected, self._resume_state = produced.collected, produced.resume_state
        shaped = collected.rewards  # what the metrics report: the task's reward, before normalisation
        # 2. Running reward normalisation (optional), its moments over all ranks.
        if self.cfg.algorithm.normalize_rewards:
            self.reward_moments.update(collected.rewards, reduce=self.sum_reduce)
            collected.rewards = self.reward_moments.normalize(collected.rewards)
        # 3. Experience: old/ref logprobs and values under the weights that sampled, then advantages.
        with explain_out_of_memory(f"step {step}, old/reference logprobs and values", self.training_memory_fixes):
            experience = make_experience(self._experience_deps(), collected)
        # 4. Update: PPO epochs over mini-batches; each optimizer step agrees across ranks.
        with self.timer("time/train"):
            loss_stats, skipped = update(self._update_deps(step), collected, experience)
        # 5. The engine samples the next step from the new weights.
        sync_fixes = [f"lower rollout.weight_sync_bucket_mb (now {self.cfg.rollout.weight_sync_bucket_mb})",
                      *self.sampling_memory_fixes]
        with self.timer("time/weight_sync"), explain_out_of_memory(f"step {step}, weight sync to the engine", sync_fixes):
            self.engine.update_weights(self.actor)
        self.rollout_producer().weights_synced()
        # 6. Metrics reduced over ranks; an adaptive KL coefficient follows the measured KL.
        metrics = self._step_metrics(collected, shaped, experience, loss_stats, skipped)
        self.kl_controller.update(metrics.get("kl", 0.0), len(collected.rollouts) * self.strategy.world_size)
        metrics["time/step"] = time.perf_counter() - start
        metrics.update(staleness_metrics(produced, self.producer))
        metrics.update(produced.times)  # async: the producer's own phases of this step's collection
        metrics.update(self.phase_times.take())
        metrics.update(sync_metrics(self.engine))
        self.step_count = step
        if self.strategy.is_main and self.logger is not None and self.cfg.logging.completions_every and \
                step % self.cfg.logging.completions_every == 0:
            self.logger.log_completions(step, completion_rows(collected, experience, step, self.output_dir,
                                                              self.cfg.logging.completions_rows))
        return metrics

    def rollout_producer(self):
        """Where steps' rollouts come from (`vlrft.trainer.producer`): built at the first step, after a resume."""
        if self.producer is None:
            self.producer = make_producer(self.cfg, self._collect_deps, self.engine_awake, self.engine,
                                          self.step_count + 1)
        return self.producer

    def _step_metrics(self, collected: Collected, rewards: torch.Tensor, exp: Experience, loss_stats: Stats,
                      skipped: int) -> dict:
        metrics = step_metrics(collected, rewards, exp, loss_stats, skipped, self.sum_reduce, self.max_reduce)
        metrics["kl_coef"] = self.kl_controller.value
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    # ------------------------------------------------------------------ loop

    def fit(self) -> list[dict[str, float]]:
        """Train to `train.total_steps`; returns the metrics of every step run by this call."""
        cfg = self.cfg
        history = []
        if self.resume_from is not None and self.step_count >= cfg.train.total_steps:  # one line, exit 0
            self.message(ckpt.nothing_to_do(self.resume_from, self.step_count, cfg.train.total_steps))
            self.release_hold()
            return history
        try:  # the old run's files are gone before any rank writes; a full disk here: one line on every rank
            self._main_decides(self._open_run_files)
        except BaseException:
            self.release_hold()
            raise
        interrupt = InterruptGuard(cfg.train.save_on_interrupt).install()
        try:
            if self.step_count == 0 and self.eval_samples and cfg.train.eval_before_training:
                metrics = self.evaluate(0)
                self._log(0, metrics)
                history.append({"step": 0, **metrics})
            while self.step_count < cfg.train.total_steps:
                metrics = self.train_step()
                step = self.step_count
                if self.eval_samples and cfg.train.eval_every and (step % cfg.train.eval_every == 0 or
                                                                   step == cfg.train.total_steps):
                    metrics.update(self.evaluate(step))
                self._log(step, metrics)
                history.append({"step": step, **metrics})
                due = (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.total_steps
                stop = self._stop_requested(interrupt)
                if due or stop:
                    with interrupt.saving():
                        saved = self.save()
                    stop = stop or self._stop_requested(interrupt)  # a Ctrl-C during the save: stop now
                if stop and step < cfg.train.total_steps:
                    raise TrainingInterrupted(f"stopped at step {step}; checkpoint saved in {saved}; continue "
                                              "with train.resume=auto", interrupt.signum)
        finally:
            if self.producer is not None:
                self.producer.close()
            interrupt.uninstall()
            try:
                if self.logger is not None:
                    self.logger.close()
            finally:
                self.release_hold()
        return history

    def _open_run_files(self) -> None:
        """On the main rank: the old run's files cleared (train.overwrite), config.yaml written, the loggers opened."""
        run_folder.clear(self._stale_run_files)
        save_config(self.cfg, self.output_dir)
        self.logger = RunLogger(self.cfg, self.output_dir, self.cfg.train.total_steps, start_step=self.step_count,
                                run_id=self.run_id)
        if self.resume_from is not None:
            self.message(f"resumed from {self.resume_from} at step {self.step_count}")

    def _stop_requested(self, interrupt: InterruptGuard) -> bool:
        """Whether a Ctrl-C or SIGTERM on any rank asked to save and stop (all ranks agree, so all save together)."""
        if not interrupt.save_on_interrupt:
            return False
        return self.max_reduce(torch.tensor([float(interrupt.requested)])).item() > 0

    def _log(self, step: int, metrics: dict) -> None:
        if self.strategy.is_main and self.logger is not None and (step % self.cfg.logging.log_every == 0 or
                                                                   any(k.startswith("eval/") for k in metrics)):
            self.logger.log(step, metrics)

    # ------------------------------------------------------------------ checkpoints

    def trainer_state(self) -> dict:
        # The sampler and engine as right after the last trained step's collection (rollout servers collect ahead)
        resume = self._resume_state or {"sampler": self.sampler.state_dict(), "engine": engine_state(self.engine)}
        return {**resume, "kl_controller": self.kl_controller.state_dict(),
                "reward_moments": self.reward_moments.state_dict(), "world_size": self.strategy.world_size,
                "run_id": self.run_id, "base_model": self.base_model}

    def save(self) -> Path:
        return ckpt.save_checkpoint(
            self.output_dir, self.step_count, strategy=self.strategy, parts=self._checkpoint_parts(),
            hf_model=self.actor.model, processor=self.processor, scheduler=self.scheduler,
            trainer_state=self.trainer_state(), keep_last=self.cfg.train.keep_last,
            export_hf=self.cfg.train.save_hf_model == "every" or self.step_count >= self.cfg.train.total_steps,
            hf_dtype=DTYPES[self.cfg.model.dtype if self.cfg.train.hf_model_dtype == "auto"
                            else self.cfg.train.hf_model_dtype])

    def _checkpoint_parts(self) -> dict[str, TrainedModel]:
        parts = {"policy": TrainedModel(self.wrapped, self.optimizer, self.scheduler)}
        if self.critic is not None:
            parts["critic"] = TrainedModel(self.critic_wrapped, self.critic_optimizer)
        return parts

    def _restore(self, folder: Path, state: dict) -> None:
        """Continue from checkpoint `folder`, whose trainer state is `state`."""
        self.step_count = int(state["step"])
        self.strategy.load_checkpoint(folder, self._checkpoint_parts())
        self.scheduler.load_state_dict(ckpt.load_scheduler_state(folder))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.reward_moments.load_state_dict(state["reward_moments"])
        load_engine_state(self.engine, state.get("engine", {}))  # vLLM/SGLang: the next call's sampling seed
        # last: nothing after this consumes randomness. A rank the checkpoint did not have (resumed on
        # more processes) keeps its seeded stream.
        ckpt.load_rank_rng(folder, self.strategy.rank, required=not self.strategy.reshards_checkpoints)

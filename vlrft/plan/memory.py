"""Per-GPU memory of a run, by arithmetic: does a config fit on the GPUs it names, and what to change if not.

Pure functions on dataclasses (no torch, no model): `plan_memory(cfg, shape, hardware, strategy)`
returns a `MemoryPlan` whose components are the bytes one GPU holds for each part of the run.
A step has two phases and the plan takes the larger:

- rollout: the engine is awake (vLLM/SGLang take `gpu_memory_utilization` of the GPU; the hf engine
  a KV cache for the rank's rollout batch) beside what the trainer keeps resident between steps
  (parameters, optimizer state, reference, critic; gradients are freed after each optimizer step);
- train: the engine sleeps; parameters, gradients, optimizer state, activations of one
  micro-batch and the LM-head chunk are alive together.

Byte counts follow what vlrft does: the trainer holds the policy in float32 and computes in
bfloat16 under autocast (DDP: 4 B parameters + 4 B gradients + 4 B DDP gradient buckets + 8 B
AdamW moments per parameter, replicated); FSDP2 shards the float32 parameters, gradients and
moments over all ranks and gathers bfloat16 copies one decoder layer at a time; DeepSpeed ZeRO
with bf16 keeps bfloat16 parameters and gradients plus a float32 master copy and moments
(ZeRO-2 shards gradients and optimizer state, ZeRO-3 also the parameters). Activation figures
are estimates per token and layer for a bf16 Llama-style block with SDPA attention (no S x S
scores), the logits chunk that `vlrft.models.logprobs` materialises, and every prompt distinct
and padded to data.max_prompt_length (the worst case). A fixed reserve covers the CUDA context,
NCCL and allocator slack.

This module adds the terms up; each is counted beside it: `activations` (a training micro-batch),
`model_state` (parameters, gradients and optimizer state per strategy, and host memory), `engine`
(the rollout engine), `reward_models`; `suggestions` says what to change, `formatting` prints it, and
`memory_plan` holds the dataclasses they share.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlrft.plan.activations import (MicroBatchSize, SharedGradients, chunk_tokens, head_backward_bytes, logits_bytes,
                                    micro_batch_size, micro_batch_terms, prompt_patches, shared_gradients)
from vlrft.plan.architecture import ModelShape
from vlrft.plan.engine import engine_components
from vlrft.plan.memory_plan import CUDA_RESERVE, Component, Hardware, MemoryPlan, StrategyChoice
from vlrft.plan.model_state import host_memory, model_state, offloaded_during_rollout, trains_sharing_prompts
from vlrft.plan.reward_models import RewardModelShape, reward_model_components
from vlrft.plan.suggestions import suggestions


def plan_memory(cfg, shape: ModelShape, hardware: Hardware, strategy: StrategyChoice,
                images_per_prompt: int = 1, suggest: bool = True,
                reward_models: Sequence[RewardModelShape] = (), videos_per_prompt: int = 0) -> MemoryPlan:
    """Per-GPU bytes of `cfg` (a `vlrft.config.Config`) for `shape` on `hardware` under `strategy`, with the
    GPU reward models `reward_models` (`vlrft.plan.reward_models.reward_model_shapes`); when it does not fit and
    `suggest`, the single changes that help (`vlrft.plan.suggestions`)."""
    world = hardware.world_size
    m = cfg.model
    params = shape.num_parameters
    if m.lora.rank > 0:
        trainable = shape.lora_parameters(m.lora.rank, m.lora.target_modules, exclude_vision=m.freeze_vision_tower)
    else:
        trainable = params - (shape.tower_count() if m.freeze_vision_tower else 0)
    hi = 2 if strategy.mixed_precision else 4
    comps = _trained_model_components(cfg, shape, strategy, world, params, trainable, hi)
    seq_len = cfg.data.max_prompt_length + cfg.rollout.tokens_after_prompt  # a trajectory with tools
    patches = prompt_patches(cfg, shape, images_per_prompt, videos_per_prompt)
    media = f"{images_per_prompt} image(s)" + (f" and {videos_per_prompt} video(s)" if videos_per_prompt else "")
    comps += _micro_batch_components(cfg, shape, strategy, world, params, hi, patches, seq_len, media)
    engine, kv_avail, kv_needed = engine_components(cfg, shape, hardware, strategy, hi, patches, seq_len)
    comps += engine
    rm_gpu, rm_host = reward_model_components(reward_models, min(hardware.gpus_per_node, world))
    comps += rm_gpu
    comps.append(Component("cuda_reserve", CUDA_RESERVE, ("load", "rollout", "train"),
                           "CUDA context, NCCL buffers, allocator slack"))
    plan = MemoryPlan(model=shape.source, parameters=params, trainable=trainable, strategy=strategy.describe(),
                      hardware=hardware, gradient_checkpointing=m.gradient_checkpointing, components=comps,
                      engine_kv_bytes=kv_avail, engine_kv_needed=kv_needed,
                      host=host_memory(cfg, shape, hardware, strategy, params, trainable) + rm_host)
    if suggest and not plan.fits:
        def replan(c=cfg, s=strategy, h=hardware, rms=reward_models) -> MemoryPlan:
            return plan_memory(c, shape, h, s, images_per_prompt, suggest=False, reward_models=rms,
                               videos_per_prompt=videos_per_prompt)

        plan.suggestions = suggestions(cfg, hardware, strategy, plan, reward_models, replan)
    return plan


def _trained_model_components(cfg, shape: ModelShape, strategy: StrategyChoice, world: int, params: int,
                              trainable: int, hi: int) -> list[Component]:
    """The trained models' state on each GPU: the policy's parameters, gradients, optimizer state, buffers and
    gathered layers, the reference (algorithm.kl_coef > 0) and the critic (GAE). `hi`: bytes of the compute dtype."""
    m, a = cfg.model, cfg.algorithm
    policy = model_state(params, trainable, shape, strategy, world)
    both, train = ("rollout", "train"), ("train",)
    # train.fsdp.offload_during_rollout: the shards, moments, reference and critic are in host memory while the
    # engine samples (`host_memory` counts them there)
    resident = train if offloaded_during_rollout(cfg, strategy) else both
    comps = [
        Component("parameters", policy.parameters, resident, policy.notes["parameters"]),
        Component("gradients", policy.gradients, resident if policy.resident_gradients else train,
                  policy.notes["gradients"]),
        Component("optimizer", policy.optimizer, resident, policy.notes["optimizer"]),
    ]
    if policy.buffers:
        comps.append(Component("buffers", policy.buffers, resident if policy.resident_buffers else train,
                               policy.notes["buffers"]))
    if policy.gathered:
        comps.append(Component("gathered_layers", policy.gathered, train, policy.notes["gathered"]))
    if a.kl_coef > 0:
        # DeepSpeed builds the reference as an inference ZeRO-3 engine whatever the policy's stage
        # (`vlrft.parallel.deepspeed`: `ds_config(trainable=False)`)
        sharded = strategy.name in ("fsdp2", "deepspeed")
        ref = hi * params // (world if sharded else 1)
        comps.append(Component("reference", ref, resident, f"{m.dtype if hi == 2 else 'float32'} reference policy, "
                               + (f"sharded (1/{world})" if sharded else "replicated")))
    if a.advantage == "gae":
        critic_params = params + shape.text.hidden_size + 1  # the backbone with a scalar value head
        critic = model_state(critic_params, critic_params, shape, strategy, world)
        # a bucket made per backward (ZeRO-2) is the policy's or the critic's, never both at once: counted once
        critic_buffers = critic.buffers if critic.resident_buffers else 0
        comps.append(Component("critic", critic.parameters + critic.optimizer + critic_buffers, resident,
                               "value model: parameters + optimizer state (as the policy)"))
        comps.append(Component("critic_gradients", critic.gradients, resident if critic.resident_gradients else train,
                               "value model gradients"))
    return comps


# Strategies whose shared-prompt backward runs one backbone call at a time, so no gradient waits for another call's
# (`vlrft.models.staged_backward`; `vlrft.parallel.strategy.Strategy.stages_backward`).
STAGED_BACKWARD = ("single", "fsdp2")


def _shared_gradients(cfg, shape: ModelShape, strategy: StrategyChoice, world: int, batch: MicroBatchSize,
                      grad_bytes: int, compute_bytes: int) -> SharedGradients:
    """The gradients the shared-prompt forward's completion pass makes and autograd holds until the prompt pass adds
    its own (`vlrft.plan.activations.SharedGradients`), where they come beside the `gradients` term, under the
    strategies that run that backward as one graph: under `ddp` from a step's second micro-batch on (the first one's
    become `.grad`, which each step frees); under DeepSpeed in every micro-batch, as whole float32 gradients (ZeRO
    reduces a parameter's `.grad` after its backward and frees it, so nothing stands in for them; measured on 2 CPU
    ranks: bench/bench_plan_zero3.py). None under `STAGED_BACKWARD` (single, fsdp2: measured, bench/bench_plan_terms.py
    and bench/bench_plan_fsdp2.py), for a family whose training forward runs every row in full (`vlrft.families`),
    or where no forward shares a prompt (`_shares_prompts`)."""
    m, t = cfg.model, cfg.train
    rank_rows = max(1, cfg.prompts_per_step // world) * cfg.rollout.n
    one_micro_batch = t.max_tokens_per_micro_batch <= 0 and rank_rows <= t.micro_batch_completions_per_rank
    if (strategy.name in STAGED_BACKWARD or not trains_sharing_prompts(shape)
            or (one_micro_batch and strategy.name in ("single", "ddp")) or not _shares_prompts(cfg, strategy, batch)):
        return SharedGradients()
    return shared_gradients(shape, grad_bytes, compute_bytes, m.lora.rank, tuple(m.lora.target_modules))


def _shares_prompts(cfg, strategy: StrategyChoice, batch: MicroBatchSize) -> bool:
    """Whether a training forward can take the shared-prompt path (`ActorVL.predicting_states`): a micro-batch of
    more than one row (two may continue one prompt), or, under the sharding strategies, every forward when the ranks'
    micro-batches differ (a token budget, or zero-advantage rows left out: `vlrft.trainer.Trainer`; taken as on
    whenever `train.skip_zero_advantage_rows` is and no critic trains, though some losses turn it off)."""
    t = cfg.train
    skips_rows = t.skip_zero_advantage_rows and cfg.algorithm.advantage != "gae"
    every_forward = strategy.name in ("fsdp2", "deepspeed") and (t.max_tokens_per_micro_batch > 0 or skips_rows)
    return batch.rows > 1 or t.max_tokens_per_micro_batch > 0 or every_forward


def _micro_batch_components(cfg, shape: ModelShape, strategy: StrategyChoice, world: int, params: int, hi: int,
                            patches: int, seq_len: int, media: str) -> list[Component]:
    """What one training micro-batch adds on each GPU: its activations, the prompt's keys and values, the LM head's
    backward and logits chunk, and autocast's bf16 copies of float32 weights. `patches`: vision patches per prompt;
    `seq_len`: a trajectory's tokens; `media`: the images and videos per prompt, in words."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    train = ("train",)
    batch = micro_batch_size(cfg, shape, world, patches, seq_len)
    vision, what, completion_tokens = batch.vision_patches, batch.what, batch.completion_tokens
    float32_weights = strategy.mixed_precision and strategy.name != "fsdp2"  # bf16 matmuls over float32 weights
    terms = micro_batch_terms(shape, batch, d.max_prompt_length, r.tokens_after_prompt, m.gradient_checkpointing, hi,
                              float32_weights, frozen_tower=m.freeze_vision_tower,
                              shared=_shared_gradients(cfg, shape, strategy, world, batch,
                                                       4 if float32_weights else hi, hi))
    comps = [Component("activations", terms["activations"], train,
                       f"{what}; {media} per prompt: {vision} vision patches; gradient checkpointing "
                       f"{'on' if m.gradient_checkpointing else 'off'}")]
    comps.append(Component("prompt_kv", terms["prompt_kv"], train,
                           "the micro-batch's prompt tokens' keys and values, every layer's, and their gradients"))
    if terms.get("pending_grads"):
        comps.append(Component("pending_grads", terms["pending_grads"], train,
                               "the completion pass's gradients of the language model's trained parameters, waiting "
                               "in autograd's buffers for the prompt pass's backward"))
    head_bytes = head_backward_bytes(shape, trained=m.lora.rank == 0, float32_weights=float32_weights,
                                     completion_tokens=completion_tokens)
    if head_bytes:  # under FSDP2 too: beside the gathered root's weight and gradient (gathered_layers)
        comps.append(Component("head_backward", head_bytes, train,
                               "the LM head's backward over the logits chunks: its float32 gradient, accumulated "
                               "before it reaches .grad" + (", and the head in bf16" if float32_weights else "")))
    if "weight_casts" in terms:
        # float32 weights under bf16 autocast: each matmul's bf16 copy of its weight is kept for the backward (ZeRO-3's
        # gathered layers' too); under checkpointing one layer's at a time. FSDP2 gathers bf16 weights: no copies.
        comps.append(Component("weight_casts", terms["weight_casts"], train,
                               "bf16 copies of the float32 weights, made by autocast and kept for the backward "
                               "(model.gradient_checkpointing: true keeps one layer's at a time)"))
    comps.append(Component("logits", logits_bytes(shape, completion_tokens), train,
                           f"LM-head chunk of {chunk_tokens(shape)} tokens x {shape.text.vocab_size} vocabulary"))
    return comps

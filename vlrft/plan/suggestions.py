"""What to change when a plan does not fit: each single change that helps, tried through the planner, best first."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from vlrft.plan.memory_plan import Hardware, MemoryPlan, StrategyChoice, in_gib
from vlrft.plan.reward_models import RewardModelShape


def _with(cfg, section: str, **changes):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def suggestions(cfg, hardware: Hardware, strategy: StrategyChoice, plan: MemoryPlan,
                reward_models: Sequence[RewardModelShape], trial: Callable[..., MemoryPlan]) -> list[str]:
    """One line per single change that helps, best first; each says the per-GPU total it would give.

    `plan`: the plan of `cfg` as it is; `trial(c=cfg, s=strategy, h=hardware, rms=reward_models)`: the plan (without
    suggestions) with one of them changed, as `vlrft.plan.memory.plan_memory` makes it."""
    out: list[tuple[bool, int, str]] = []

    def add(text: str, p: MemoryPlan) -> None:
        if p.total < plan.total or (p.engine_ok and not plan.engine_ok):
            verdict = "fits" if p.fits else "still too much"
            out.append((not p.fits, p.total, f"{text} (-> {in_gib(p.total)} per GPU, {verdict})"))

    resident = [rm.key for rm in reward_models if not rm.offload]
    if resident:
        add(f"set offload: true in the kwargs of reward model(s) {', '.join(resident)}",
            trial(rms=[dataclasses.replace(rm, offload=True) for rm in reward_models]))
    if not cfg.model.gradient_checkpointing:
        add("set model.gradient_checkpointing: true", trial(c=_with(cfg, "model", gradient_checkpointing=True)))
    if strategy.name in ("single", "ddp") and hardware.world_size > 1:
        add("set train.strategy: fsdp2", trial(s=dataclasses.replace(strategy, name="fsdp2")))
        add("set train.strategy: deepspeed with ZeRO-3",
            trial(s=dataclasses.replace(strategy, name="deepspeed", zero_stage=3)))
    if strategy.name in ("single", "ddp"):
        add("set train.strategy: fsdp2 with train.fsdp.cpu_offload: true",
            trial(s=dataclasses.replace(strategy, name="fsdp2", offload_optimizer=True, offload_params=True)))
    if strategy.name == "deepspeed" and strategy.zero_stage < 3:
        add("use ZeRO stage 3 (train.deepspeed.zero_stage: 3)", trial(s=dataclasses.replace(strategy, zero_stage=3)))
    if not strategy.offload_optimizer and strategy.name in ("fsdp2", "deepspeed"):
        key = "train.fsdp.cpu_offload: true" if strategy.name == "fsdp2" else "train.deepspeed.offload_optimizer: true"
        add(f"offload to the CPU ({key})", trial(s=dataclasses.replace(strategy, offload_optimizer=True)))
    budget = cfg.train.max_tokens_per_micro_batch
    seq_len = cfg.data.max_prompt_length + cfg.rollout.tokens_after_prompt
    while budget > seq_len:  # with a token budget the rows do not bound a forward; the budget does
        budget = max(seq_len, budget // 2)
        p = trial(c=_with(cfg, "train", max_tokens_per_micro_batch=budget))
        if p.fits or budget == seq_len:
            add(f"lower train.max_tokens_per_micro_batch to {budget}", p)
            break
    mb = cfg.train.micro_batch_completions_per_rank if not cfg.train.max_tokens_per_micro_batch else 1
    while mb > 1:
        mb //= 2
        p = trial(c=_with(cfg, "train", micro_batch_completions_per_rank=mb))
        if p.fits or mb == 1:
            add(f"lower train.micro_batch_completions_per_rank to {mb}", p)
            break
    t = cfg.train
    if plan.component("pending_grads") and strategy.name == "deepspeed" and not t.max_tokens_per_micro_batch:
        # one row a micro-batch, no rows left out: no forward shares a prompt, so no gradient waits for a prompt pass
        lower = ("lower train.micro_batch_completions_per_rank to 1 and "
                 if t.micro_batch_completions_per_rank > 1 else "")
        add(f"{lower}set train.skip_zero_advantage_rows: false (no forward shares a prompt: no pending_grads)",
            trial(c=_with(cfg, "train", micro_batch_completions_per_rank=1, skip_zero_advantage_rows=False)))
    r = cfg.rollout
    if r.engine not in ("hf", "vllm_server"):
        rollout_free = plan.capacity - (plan.phase_total("rollout") - plan.component("engine_weights")
                                        - plan.component("engine_kv_cache"))
        best = int(100 * rollout_free / plan.capacity) / 100
        if 0 < best < r.gpu_memory_utilization:
            add(f"lower rollout.gpu_memory_utilization to {best:.2f}",
                trial(c=_with(cfg, "rollout", gpu_memory_utilization=best)))
        if not plan.engine_ok:
            for tp in (2, 4, 8):
                if tp > r.tensor_parallel_size and hardware.gpus_per_node % tp == 0:
                    add(f"raise rollout.tensor_parallel_size to {tp}",
                        trial(c=_with(cfg, "rollout", tensor_parallel_size=tp)))
                    break
    for nodes in (hardware.nodes * 2, hardware.nodes * 4):
        p = trial(h=dataclasses.replace(hardware, nodes=nodes))
        if p.fits and strategy.name not in ("single", "ddp"):
            add(f"use {nodes} nodes of {hardware.gpus_per_node} GPUs", p)
            break
    out.sort(key=lambda item: (item[0], item[1]))
    return [text for _, _, text in out]


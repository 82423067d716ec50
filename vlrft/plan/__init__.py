"""The memory plan: per-GPU bytes of a config by arithmetic on the model's config.json (`vlrft plan`).

`plan_for_config` is what both `vlrft plan` and the trainer's load-time check call;
`check_fits_at_load` stops a CUDA run with one line when the plan says it cannot fit, and
`host_memory_warning` says when the first node's host memory will not hold what the plan puts there.
"""

from __future__ import annotations

import os
from pathlib import Path

from vlrft.errors import UserError
from vlrft.plan.architecture import ModelShape, load_model_shape, shape_from_config
from vlrft.plan.formatting import format_plan
from vlrft.plan.memory import plan_memory
from vlrft.plan.memory_plan import PHASES, GiB, Hardware, MemoryPlan, StrategyChoice
from vlrft.plan.reward_models import reward_model_shapes

__all__ = ["GiB", "Hardware", "MemoryPlan", "ModelShape", "StrategyChoice", "check_fits", "check_fits_at_load", "format_plan",
           "host_memory_warning", "load_model_shape", "node_memory_bytes", "plan_for_config", "plan_memory",
           "shape_from_config", "strategy_from_config"]

SKIP_ENV = "VLRFT_SKIP_MEMORY_PLAN"


def strategy_from_config(cfg, name: str | None = None, zero_stage: int | None = None,
                         offload: bool | None = None, mixed_precision: bool | None = None) -> StrategyChoice:
    """The strategy of `cfg.train` (options read leniently: `train.deepspeed.*`, `train.fsdp.cpu_offload`),
    with command-line overrides. `mixed_precision` None: low-precision compute unless model.dtype is float32."""
    t = cfg.train
    if mixed_precision is None:
        mixed_precision = getattr(getattr(cfg, "model", None), "dtype", "bfloat16") != "float32"
    name = name or t.strategy
    ds, fsdp = getattr(t, "deepspeed", None), getattr(t, "fsdp", None)
    stage = zero_stage if zero_stage is not None else int(getattr(ds, "zero_stage", 3) or 3)
    if name == "fsdp2":
        off = bool(getattr(fsdp, "cpu_offload", False))
        opt_off = param_off = off
    else:
        opt_off = bool(getattr(ds, "offload_optimizer", False))
        param_off = bool(getattr(ds, "offload_params", getattr(ds, "offload_param", False)))
    if offload is not None:
        opt_off = param_off = offload
    if name == "deepspeed" and stage not in (2, 3):
        raise UserError(f"plan: ZeRO stage {stage} is not one vlrft runs; use 2 or 3")
    return StrategyChoice(name=name, zero_stage=stage, offload_optimizer=opt_off, offload_params=param_off,
                          mixed_precision=mixed_precision)


def plan_for_config(cfg, hardware: Hardware, strategy: StrategyChoice | None = None, model_config: str | None = None,
                    images_per_prompt: int = 1, videos_per_prompt: int = 0) -> MemoryPlan:
    shape = load_model_shape(cfg.model.path, model_config)
    reward_models, not_counted = reward_model_shapes(cfg.reward)
    plan = plan_memory(cfg, shape, hardware, strategy or strategy_from_config(cfg), images_per_prompt,
                       reward_models=reward_models, videos_per_prompt=videos_per_prompt)
    plan.not_counted += not_counted
    return plan


def check_fits(cfg, hardware: Hardware, images_per_prompt: int = 1, videos_per_prompt: int = 0) -> MemoryPlan | None:
    """Raise a one-line `UserError` when the plan of `cfg` on `hardware` does not fit; None when it cannot plan."""
    try:
        plan = plan_for_config(cfg, hardware, images_per_prompt=images_per_prompt, videos_per_prompt=videos_per_prompt)
    except UserError:
        return None  # a model the plan cannot read (another architecture, no config.json): nothing to check
    if not plan.fits:
        hint = plan.suggestions[0] if plan.suggestions else "use more or larger GPUs"
        raise UserError(f"memory plan: this run needs about {plan.total / GiB:.1f} GiB per GPU ({plan.peak_phase} "
                        f"phase) but the GPU has {plan.capacity / GiB:.1f} GiB; try: {hint}. See `vlrft plan CONFIG` "
                        f"for the breakdown, or set {SKIP_ENV}=1 to start anyway")
    return plan


def check_fits_at_load(cfg, world_size: int, images_per_prompt: int = 1, videos_per_prompt: int = 0
                       ) -> MemoryPlan | None:
    """On CUDA, `check_fits` for the GPUs this job runs on (the data's most images and videos in a prompt); a
    no-op on CPU.

    Set VLRFT_SKIP_MEMORY_PLAN=1 to start anyway (the plan is an estimate on the conservative side).
    """
    import torch

    if not torch.cuda.is_available() or os.environ.get(SKIP_ENV) == "1":
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(world_size, torch.cuda.device_count()) or 1))
    hardware = Hardware(gpus_per_node=per_node, nodes=max(1, world_size // per_node),
                        gpu_memory=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return check_fits(cfg, hardware, images_per_prompt, videos_per_prompt)


def node_memory_bytes(cgroup_root: Path = Path("/sys/fs/cgroup"), own_cgroups: Path = Path("/proc/self/cgroup")) -> int:
    """The memory this process may use: the machine's RAM, or the lowest memory limit of its cgroup and the cgroups
    above it (a Kubernetes pod or a Slurm job is killed at its limit, not at the machine's RAM)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        lines = own_cgroups.read_text().splitlines()  # "0::/path" (v2), "4:memory:/path" (v1)
    except OSError:
        return total
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:  # a line this reading does not know: no limit learnt from it
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0":
            top, limit_file = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            top, limit_file = cgroup_root / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = top / path.strip("/")
        for level in [folder, *folder.parents]:
            try:
                text = (level / limit_file).read_text().strip()
            except OSError:
                text = ""
            if text.isdigit():  # "max" (v2) or a huge number (v1) when there is no limit
                total = min(total, int(text))
            if level == top:
                break
    return total


def host_memory_warning(plan: MemoryPlan, node_memory: int) -> str | None:
    """One line when the plan's host memory of the first node exceeds `node_memory`, else None.

    A warning, not an error: the checkpoint read is memory-mapped (the kernel can drop its pages), and the plan
    does not count the processes' own memory; but past the node's memory the kernel kills the job without a
    Python traceback, so it is said before any model loads."""
    if not plan.host:
        return None
    phase = max(PHASES, key=plan.host_total)
    need = plan.host_total(phase)
    if need <= node_memory:
        return None
    largest = max((c for c in plan.host if phase in c.phases), key=lambda c: c.bytes)
    return (f"memory plan: the first node needs about {need / GiB:.1f} GiB of host memory ({phase} phase; the "
            f"largest part: {largest.name}, {largest.bytes / GiB:.1f} GiB) but has {node_memory / GiB:.1f} GiB; the "
            "kernel may kill the job. Offload less (train.fsdp.cpu_offload, train.fsdp.offload_during_rollout, "
            "train.deepspeed.offload_*) or use more nodes; `vlrft plan CONFIG` shows the breakdown")

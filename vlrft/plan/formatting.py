"""The table `vlrft plan` prints."""

from __future__ import annotations

from vlrft.plan.memory_plan import PHASES, MemoryPlan, in_gib


def format_plan(plan: MemoryPlan) -> str:
    """The human-readable table `vlrft plan` prints."""
    hw = plan.hardware
    lines = [f"model        {plan.model}: {plan.parameters / 1e9:.3f} B parameters "
             f"({plan.trainable / 1e9:.3f} B trained)",
             f"hardware     {hw.nodes} node(s) x {hw.gpus_per_node} GPUs x {in_gib(hw.gpu_memory)} "
             f"= {hw.world_size} ranks; strategy {plan.strategy}", "",
             f"{'per GPU':<26}{'bytes':>12}  {'phase':<15}note"]
    for c in plan.components:
        phases = "+".join(c.phases)
        lines.append(f"  {c.name:<24}{in_gib(c.bytes):>12}  {phases:<15}{c.note}")
    for phase in PHASES:
        if phase != "load" or any(phase in c.phases and c.name != "cuda_reserve" for c in plan.components):
            lines.append(f"  {'total while ' + phase:<24}{in_gib(plan.phase_total(phase)):>12}")
    if plan.engine_kv_bytes is not None:
        lines.append(f"  engine KV cache {in_gib(plan.engine_kv_bytes)} available, {in_gib(plan.engine_kv_needed)} "
                     "needed for one sequence of max_model_len tokens")
    if plan.host:
        lines += ["", f"{'host memory, first node':<26}{'bytes':>12}  {'phase':<20}note"]
        for c in plan.host:
            lines.append(f"  {c.name:<24}{in_gib(c.bytes):>12}  {'+'.join(c.phases):<20}{c.note}")
        lines.append("  " + ", ".join(f"{phase} {in_gib(plan.host_total(phase))}" for phase in PHASES)
                     + " (the policy's part; processes and page cache come on top)")
    lines += [f"not counted: {what}" for what in plan.not_counted]
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines += ["", f"{verdict}: peak {in_gib(plan.total)} ({plan.peak_phase}) of {in_gib(plan.capacity)} per GPU"]
    if plan.suggestions:
        lines.append("to make it fit, change one of:")
        lines += [f"  - {s}" for s in plan.suggestions]
    return "\n".join(lines)

"""Rollout engines: transformers `generate` (embedded default), vLLM and SGLang (optional, imported lazily)."""

from __future__ import annotations

from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, EngineDeps, RolloutEngine, Rollouts, SamplingParams

ENGINES = ("hf", "vllm", "sglang")


def make_engine(cfg, deps: EngineDeps) -> RolloutEngine:
    """The engine `rollout.engine` names, built once on this rank around the policy `deps.actor` (multi-turn around
    it when `rollout.tools` is set)."""
    engine = _make_engine(cfg, deps)
    if cfg.rollout.tools:
        from vlrft.rollout.multiturn import MultiTurnEngine

        return MultiTurnEngine.from_deps(cfg, deps, engine)
    return engine


def _make_engine(cfg, deps: EngineDeps) -> RolloutEngine:
    name = cfg.rollout.engine
    if name == "hf":
        from vlrft.rollout.hf import HFEngine

        actor = deps.actor
        return HFEngine(lambda: actor.model, deps.processor, deps.tokens,
                        max_batch_prompts=max(1, deps.prompts_per_rank),
                        whole_weights=lambda: deps.strategy.generation(actor),
                        compile_decode=cfg.rollout.compile_decode, lean_decode=cfg.rollout.lean_decode,
                        cuda_graph_decode=cfg.rollout.cuda_graph_decode, autocast=deps.autocast)
    if name == "vllm":
        from vlrft.rollout.vllm import VLLMEngine

        return VLLMEngine.from_deps(cfg, deps)
    if name == "sglang":
        from vlrft.rollout.sglang import SGLangEngine

        return SGLangEngine.from_deps(cfg, deps)
    raise ValueError(f"unknown rollout engine {name!r}; expected one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "EngineDeps", "FINISH_LENGTH", "FINISH_STOP", "RolloutEngine", "Rollouts", "SamplingParams",
           "make_engine"]

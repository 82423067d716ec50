"""Rollout engines: transformers `generate` (embedded default), vLLM and SGLang (optional, imported lazily)."""

from __future__ import annotations

from vlrft.families import ENGINES
from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, EngineDeps, RolloutEngine, Rollouts, SamplingParams


def make_engine(cfg, deps: EngineDeps) -> RolloutEngine:
    """The engine `rollout.engine` names, built once on this rank around the policy `deps.actor` (multi-turn around
    it when `rollout.tools` is set)."""
    engine = _make_engine(cfg, deps)
    if cfg.rollout.tools:
        from vlrft.rollout.multiturn import MultiTurnEngine

        return MultiTurnEngine.from_deps(cfg, deps, engine)
    return engine


def _check_engine_family(name: str, actor) -> None:
    """Refuse an engine the family table (`vlrft.families`) marks refused for the policy's family, in one line with
    the table's reason and the engines that take the family, before the engine starts."""
    from vlrft.errors import UserError
    from vlrft.families import family
    from vlrft.models.actor import base_of

    model = getattr(actor, "model", None)
    model_type = getattr(getattr(base_of(model), "config", None), "model_type", None) if model is not None else None
    if name not in ENGINES or name == "hf" or not isinstance(model_type, str):
        return
    fam = family(model_type)
    if fam is None:
        raise UserError(f"rollout.engine={name} is not tested with model family '{model_type}'; use rollout.engine=hf")
    if not fam.engine(name).supported:
        raise UserError(f"rollout.engine={name} does not take {fam.name} ({model_type}): {fam.engine(name).refused}; "
                        f"use rollout.engine={' or '.join(fam.supported_engines())}")


def _make_engine(cfg, deps: EngineDeps) -> RolloutEngine:
    name = cfg.rollout.engine
    _check_engine_family(name, getattr(deps, "actor", None))
    if name == "hf":
        from vlrft.rollout.hf import HFEngine

        actor = deps.actor
        return HFEngine(lambda: actor.model, deps.processor, deps.tokens,
                        max_batch_prompts=max(1, deps.prompts_per_rank),
                        whole_weights=lambda: deps.strategy.generation(actor),
                        lean_decode=cfg.rollout.lean_decode,
                        cuda_graph_decode=cfg.rollout.cuda_graph_decode, autocast=deps.autocast)
    if name == "vllm":
        from vlrft.rollout.vllm import VLLMEngine

        return VLLMEngine.from_deps(cfg, deps)
    if name == "vllm_server":
        from vlrft.rollout.server import ServerEngine

        return ServerEngine.from_deps(cfg, deps)
    if name == "sglang":
        from vlrft.rollout.sglang import SGLangEngine

        return SGLangEngine.from_deps(cfg, deps)
    raise ValueError(f"unknown rollout engine {name!r}; expected one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "EngineDeps", "FINISH_LENGTH", "FINISH_STOP", "RolloutEngine", "Rollouts", "SamplingParams",
           "make_engine"]

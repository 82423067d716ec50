"""Rollout engines: transformers `generate` (embedded default), vLLM and SGLang (optional, imported lazily)."""

from __future__ import annotations

from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, EngineDeps, RolloutEngine, Rollouts, SamplingParams

ENGINES = ("hf", "vllm", "sglang", "vllm_server")
# The model families each engine server is tested with (tests/test_engine_contracts.py, tests/test_vllm_executed.py);
# the hf engine runs every family vlrft loads (vlrft.models.loading.SUPPORTED_FAMILIES).
SERVER_ENGINE_FAMILIES = {"vllm": ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "llava_onevision",
                                   "internvl"),
                          # executed through a real server: tests/test_vllm_server_engine.py, tests/test_vllm_server.py
                          "vllm_server": ("qwen2_vl", "qwen2_5_vl"),
                          "sglang": ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}


def make_engine(cfg, deps: EngineDeps) -> RolloutEngine:
    """The engine `rollout.engine` names, built once on this rank around the policy `deps.actor` (multi-turn around
    it when `rollout.tools` is set)."""
    engine = _make_engine(cfg, deps)
    if cfg.rollout.tools:
        from vlrft.rollout.multiturn import MultiTurnEngine

        return MultiTurnEngine.from_deps(cfg, deps, engine)
    return engine


def _check_engine_family(name: str, actor) -> None:
    """Refuse a server engine for a family its prompt folding and weight names were never tested with (Gemma 3's
    placeholders expand to text around the image tokens; SGLang never ran GLM-4.1V), in one line naming the way out,
    before the engine starts."""
    from vlrft.errors import UserError
    from vlrft.models.actor import base_of

    model = getattr(actor, "model", None)
    model_type = getattr(getattr(base_of(model), "config", None), "model_type", None) if model is not None else None
    tested = SERVER_ENGINE_FAMILIES.get(name)
    if tested and isinstance(model_type, str) and model_type not in tested:
        raise UserError(f"rollout.engine={name} is not tested with model family '{model_type}' (only with "
                        f"{', '.join(tested)}); use rollout.engine=hf")


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

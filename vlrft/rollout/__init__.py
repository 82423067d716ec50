"""Rollout engines: transformers `generate` (embedded default), vLLM and SGLang (optional, imported lazily)."""

from __future__ import annotations

from vlrft.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutEngine, Rollouts, SamplingParams

ENGINES = ("hf", "vllm", "sglang")


def make_engine(cfg, trainer) -> RolloutEngine:
    """The engine `rollout.engine` names, built once on this rank around the trainer's policy."""
    name = cfg.rollout.engine
    if name == "hf":
        from vlrft.rollout.hf import HFEngine

        actor = trainer.actor
        return HFEngine(lambda: actor.model, trainer.processor, trainer.tokens,
                        max_batch_prompts=max(1, trainer.prompts_per_rank),
                        whole_weights=lambda: trainer.strategy.generation(actor),
                        compile_decode=cfg.rollout.compile_decode)
    if name == "vllm":
        from vlrft.rollout.vllm import VLLMEngine

        return VLLMEngine.from_trainer(cfg, trainer)
    if name == "sglang":
        from vlrft.rollout.sglang import SGLangEngine

        return SGLangEngine.from_trainer(cfg, trainer)
    raise ValueError(f"unknown rollout engine {name!r}; expected one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "FINISH_LENGTH", "FINISH_STOP", "RolloutEngine", "Rollouts", "SamplingParams", "make_engine"]

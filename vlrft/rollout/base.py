"""The rollout-engine protocol: sample a group of completions per prompt from the prompt's own token ids.

Every engine receives exactly the prompt token ids and visual inputs our processor made (never
re-tokenized text), and returns, per completion, the generated ids, the engine's per-token
logprobs and why it finished. Completions of one prompt are contiguous: completion `j` of prompt
`p` is row `p * n + j`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

# SamplingParams and the finish reasons live below every engine and the decoder (vlrft.sampling)
from vlrft.sampling import FINISH_LENGTH, FINISH_STOP, SamplingParams  # noqa: F401
from vlrft.tokens import TokenSpec  # noqa: F401  the token ids every engine is built with (vlrft.tokens)

if TYPE_CHECKING:
    import torch

    from vlrft.config import RolloutConfig
    from vlrft.data import PromptBatch, PromptEncoder


@dataclass
class Rollouts:
    """Completions for a PromptBatch: `n` per prompt, prompt `p`'s group at rows `p*n .. p*n+n-1`."""

    n: int
    completion_ids: list[list[int]]  # generated ids up to and including the stop token; never padding
    finish_reasons: list[str]  # FINISH_STOP or FINISH_LENGTH
    logprobs: list[list[float]] | None = None  # engine logprob of each generated id (same lengths); None if not asked
    texts: list[str] = field(default_factory=list)  # decoded completions (special tokens removed), filled by the engine

    def __post_init__(self) -> None:
        if len(self.completion_ids) != len(self.finish_reasons) or len(self.completion_ids) % self.n:
            raise ValueError(f"rollouts: {len(self.completion_ids)} completions, {len(self.finish_reasons)} finish "
                             f"reasons, group size {self.n}")

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_prompts(self) -> int:
        return len(self.completion_ids) // self.n

    @property
    def prompt_index(self) -> list[int]:
        return [i // self.n for i in range(len(self.completion_ids))]

    @property
    def truncated(self) -> list[bool]:
        return [reason == FINISH_LENGTH for reason in self.finish_reasons]

    def select_groups(self, groups: list[int]) -> "Rollouts":
        """Keep whole groups (prompt indices), in the order given."""
        rows = [g * self.n + j for g in groups for j in range(self.n)]
        return Rollouts(
            n=self.n,
            completion_ids=[self.completion_ids[r] for r in rows],
            finish_reasons=[self.finish_reasons[r] for r in rows],
            logprobs=None if self.logprobs is None else [self.logprobs[r] for r in rows],
            texts=[self.texts[r] for r in rows] if self.texts else [],
        )

    @classmethod
    def concat(cls, parts: list["Rollouts"]) -> "Rollouts":
        n = parts[0].n
        if any(p.n != n for p in parts):
            raise ValueError("cannot concatenate rollouts with different group sizes")
        has_logprobs = all(p.logprobs is not None for p in parts)
        return cls(
            n=n,
            completion_ids=[c for p in parts for c in p.completion_ids],
            finish_reasons=[f for p in parts for f in p.finish_reasons],
            logprobs=[lp for p in parts for lp in p.logprobs] if has_logprobs else None,
            texts=[t for p in parts for t in p.texts] if all(p.texts for p in parts) else [],
        )


def cut_at_stop(ids: list[int], stop_ids: set[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Keep ids up to and including the first stop id; the finish reason comes from that, not from guesses."""
    for i, tok in enumerate(ids):
        if tok in stop_ids:
            return ids[: i + 1], FINISH_STOP
    if len(ids) >= max_new_tokens:
        return ids[:max_new_tokens], FINISH_LENGTH
    # The engine stopped early without a stop id (a stop string matched); it is a normal stop.
    return ids, FINISH_STOP


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from an engine. Engines are built on the ranks that generate, once."""

    def generate(self, batch: "PromptBatch", sampling: SamplingParams) -> Rollouts:
        """Sample `sampling.n` completions for every prompt of `batch`."""

    def update_weights(self, model: "torch.nn.Module") -> None:
        """Load the policy's current weights into the engine (no-op when the engine shares them)."""

    def sleep(self) -> None:
        """Release accelerator memory (KV cache, weights) while the trainer runs; no-op where it means nothing."""

    def wake(self) -> None:
        """Take back what `sleep` released, before the next `generate`."""


def engine_state(engine) -> dict:
    """What an engine saves with a checkpoint (its `state_dict`, where it has one: vLLM/SGLang count their calls to
    seed each one); an engine that samples from the trainer's own random streams (hf) saves nothing."""
    state_dict = getattr(engine, "state_dict", None)
    return state_dict() if callable(state_dict) else {}


def load_engine_state(engine, state: dict) -> None:
    load = getattr(engine, "load_state_dict", None)
    if callable(load) and state:
        load(state)


@dataclass(frozen=True)
class EngineDeps:
    """What `vlrft.rollout.make_engine` builds an engine around on this rank."""

    actor: torch.nn.Module  # the unwrapped policy (`ActorVL`): the engine samples from its weights
    processor: Any  # the model's processor (tokenizer, image processor)
    tokens: TokenSpec  # pad/eos/stop and suppressed token ids
    strategy: Any  # vlrft.parallel Strategy: rank, world_size, device; `generation(actor)` makes weights whole
    prompts_per_rank: int  # prompts per step on this rank (the HF engine's batch)
    encoder: PromptEncoder | None = None  # multi-turn (`rollout.tools`) describes the tools in its prompts
    # The trainer's mixed precision (autocast on GPUs, nothing on CPU), under which the hf engine samples
    autocast: Callable[[], AbstractContextManager] = nullcontext
    # vLLM/SGLang load the policy's current weights once built; False when the trainer syncs them itself later (a
    # resume whose weights come from the strategy's checkpoint: one sync of the restored weights, not two)
    sync_weights_at_start: bool = True

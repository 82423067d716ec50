"""The rollout-engine protocol: sample a group of completions per prompt from the prompt's own token ids.

Every engine receives exactly the prompt token ids and visual inputs our processor made (never
re-tokenized text), and returns, per completion, the generated ids, the engine's per-token
logprobs and why it finished. Completions of one prompt are contiguous: completion `j` of prompt
`p` is row `p * n + j`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

# SamplingParams and the finish reasons live below every engine and the decoder (vlrft.sampling)
from vlrft.sampling import FINISH_LENGTH, FINISH_STOP, SamplingParams  # noqa: F401
from vlrft.tokens import TokenSpec  # noqa: F401  the token ids every engine is built with (vlrft.tokens)

if TYPE_CHECKING:
    import torch

    from vlrft.batch import SequenceBatch
    from vlrft.data import PromptBatch, PromptEncoder
    from vlrft.tools.types import ToolStats
    from vlrft.vision import VisualBatch


@dataclass
class Rollouts:
    """Completions for a PromptBatch: `n` per prompt, prompt `p`'s group at rows `p*n .. p*n+n-1`.

    Every row is a trajectory: the model's turns and, with tools (`vlrft.rollout.multiturn`), the observations
    between them. The multi-turn fields below hold one entry per row; None means each row is a trajectory of one
    turn (every completion token sampled, no tool images, rewards or counters), and the accessors under them give the
    trainer the same values for both, so it has one path for single- and multi-turn rows.
    """

    n: int
    completion_ids: list[list[int]]  # generated ids up to and including the stop token; never padding
    finish_reasons: list[str]  # FINISH_STOP or FINISH_LENGTH (multi-turn also "max_turns")
    logprobs: list[list[float]] | None = None  # engine logprob of each generated id (same lengths); None if not asked
    texts: list[str] = field(default_factory=list)  # decoded completions (special tokens removed), filled by the engine
    # Multi-turn: 1 on model-sampled tokens, 0 on observation text, templates and image placeholders (same lengths as
    # completion_ids); only sampled tokens train, and `logprobs` there are 0
    sampled_mask: list[list[int]] | None = None
    observation_visual: list[VisualBatch | None] | None = None  # multi-turn: the tool images' tensors; None: no images
    observation_images: list[list[Any]] | None = None  # multi-turn: the tool images as processed (PIL), in order
    turns: list[int] | None = None  # multi-turn: model turns
    tool_rewards: list[float] | None = None  # multi-turn: summed reward parts of the row's tool outputs
    tool_stats: list[ToolStats] | None = None  # multi-turn: what the row's tool calls did (vlrft.tools.ToolStats)
    # Multi-turn, when recorded (completions.jsonl, TensorBoard): per row, what happened turn by turn. A model turn is
    # {"role": "assistant", "text", "finish"}; a call {"role": "tool", "call": {"name", "arguments"} or None, "status",
    # "text", "images", "reward", "shown"} (status "ok", a tools/* counter name, "unanswered" or "cut")
    transcripts: list[list[dict]] | None = None
    # Rollout servers: the weight version that sampled each row (0: as loaded, +1 per sync); None: colocated engines,
    # which always sample with the trainer's current weights
    weight_versions: list[int] | None = None

    # Per-row fields that may be None; `texts` is left out: [] is its "not filled"
    _OPTIONAL_ROWS = ("logprobs", "sampled_mask", "observation_visual", "observation_images", "turns", "tool_rewards",
                      "tool_stats", "transcripts", "weight_versions")

    def __post_init__(self) -> None:
        if len(self.completion_ids) != len(self.finish_reasons) or len(self.completion_ids) % self.n:
            raise ValueError(f"rollouts: {len(self.completion_ids)} completions, {len(self.finish_reasons)} finish "
                             f"reasons, group size {self.n}")
        for name in self._OPTIONAL_ROWS:
            values = getattr(self, name)
            if values is not None and len(values) != len(self.completion_ids):
                raise ValueError(f"rollouts: {len(self.completion_ids)} completions but {len(values)} {name}")

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

    def sampled_row(self, row: int) -> list[int]:
        """1 on each token of the row the model sampled (the tokens that train): all of a single-turn completion."""
        return self.sampled_mask[row] if self.sampled_mask is not None else [1] * len(self.completion_ids[row])

    @property
    def sampled(self) -> list[list[int]]:
        """`sampled_row` of every row."""
        return [self.sampled_row(r) for r in range(len(self))]

    def with_tool_rewards(self, total: "torch.Tensor") -> "torch.Tensor":
        """`total` [N] (the reward functions' combined reward) plus the reward parts the row's tools returned; without
        tools `total` itself (not `total + 0`, which would turn a -0.0 into 0.0)."""
        if self.tool_rewards is None:
            return total
        import torch

        return total + torch.tensor(self.tool_rewards, dtype=total.dtype)

    def select_groups(self, groups: list[int]) -> "Rollouts":
        """Keep whole groups (prompt indices), in the order given."""
        rows = [g * self.n + j for g in groups for j in range(self.n)]
        optional = {name: None if getattr(self, name) is None else [getattr(self, name)[r] for r in rows]
                    for name in self._OPTIONAL_ROWS}
        return type(self)(n=self.n, completion_ids=[self.completion_ids[r] for r in rows],
                          finish_reasons=[self.finish_reasons[r] for r in rows],
                          texts=[self.texts[r] for r in rows] if self.texts else [], **optional)

    @classmethod
    def concat(cls, parts: list["Rollouts"]) -> "Rollouts":
        """The rows of `parts` in order; an optional field is kept when every part has it (a multi-turn field when
        one part has it and another not is an error: the parts came from different engines)."""
        n = parts[0].n
        if any(p.n != n for p in parts):
            raise ValueError("cannot concatenate rollouts with different group sizes")
        optional = {}
        for name in cls._OPTIONAL_ROWS:
            present = [getattr(p, name) is not None for p in parts]
            if name not in ("logprobs", "transcripts", "weight_versions") and any(present) and not all(present):
                raise ValueError(f"cannot concatenate rollouts with and without {name} (single- and multi-turn)")
            optional[name] = [v for p in parts for v in getattr(p, name)] if all(present) else None
        return cls(n=n, completion_ids=[c for p in parts for c in p.completion_ids],
                   finish_reasons=[f for p in parts for f in p.finish_reasons],
                   texts=[t for p in parts for t in p.texts] if all(p.texts for p in parts) else [], **optional)

    def metrics(self) -> dict[str, tuple[float, float]]:
        """Tool metrics as (sum, count), so ranks can add them: per-trajectory means of turns, tool calls and each
        failure kind, and the fraction of tokens sampled. Empty without tools."""
        if self.tool_stats is None:
            return {}
        from vlrft.tools.types import ToolStats

        rows = float(len(self))
        total = sum(self.tool_stats, ToolStats())
        out = {name: (value, rows) for name, value in total.as_dict().items()}
        out["tools/turns"] = (float(sum(self.turns or [])), rows)
        sampled = self.sampled
        out["tools/sampled_token_frac"] = (float(sum(sum(m) for m in sampled)),
                                           float(max(1, sum(len(m) for m in sampled))))
        return out

    def sequences(self, prompts: "PromptBatch", rows: list[int], pad_id: int) -> "SequenceBatch":
        """Training rows `rows` in the shared-prompt layout (`vlrft.batch`): the completion mask is the sampled mask,
        and tool images ride along per row (`completion_visual`, None when no row has one)."""
        import torch

        from vlrft.batch import build_sequences
        from vlrft.vision import VisualBatch

        seqs = build_sequences(prompts.prompt_ids, prompts.visual, self.completion_ids, self.prompt_index, pad_id, rows)
        mask = torch.zeros_like(seqs.completion_mask)
        for i, r in enumerate(rows):
            sampled = self.sampled_row(r)
            mask[i, :len(sampled)] = torch.as_tensor(sampled, dtype=mask.dtype)
        visual = self.observation_visual or [None] * len(self)
        extra = None
        if any(visual[r] is not None for r in rows):
            merge = prompts.visual.merge_size
            extra = VisualBatch.concat([visual[r] or VisualBatch.empty(1, merge) for r in rows])
        return dataclasses.replace(seqs, completion_mask=mask, completion_visual=extra)

    def row_visual(self, prompts: "PromptBatch", row: int) -> "VisualBatch":
        """The row's visual tensors as one sample: the prompt's images, then the tools' in arrival order."""
        from vlrft.batch import join_samples

        own = prompts.visual.select([self.prompt_index[row]])
        extra = None if self.observation_visual is None else self.observation_visual[row]
        return own if extra is None else join_samples([own, extra])


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


def sync_metrics(engine) -> dict[str, float]:
    """What the engine's last weight sync measured beyond its time: a rollout server's `time/weight_sync_paused`, the
    seconds the servers were paused (generation overlaps the rest; set on the rank that sends)."""
    stats = getattr(engine, "last_sync", None)
    return {} if stats is None else {"time/weight_sync_paused": stats.paused_seconds}


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

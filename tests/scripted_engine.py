"""Test doubles for rollout engines, used by the FSDP2 tests.

`ScriptedEngine` is a stand-in for sampling: each completion is a fixed function of its prompt's
token ids and its index in the group, so the global batch of a step is the same whatever the
number of ranks and whatever each rank's random state. That makes a 2-rank run comparable with a
single-process run weight for weight. `RecordingEngine` records what a weight sync sends.
"""

from __future__ import annotations

import random
import zlib

import torch

from vlrft.rollout.base import FINISH_STOP, Rollouts


class ScriptedEngine:
    """Test double for a rollout engine: deterministic completions per prompt, nothing sampled."""

    def __init__(self, trainer):
        self.tokenizer = trainer.processor.tokenizer
        self.eos = trainer.tokens.eos_ids[0]
        special = set(self.tokenizer.all_special_ids) | set(trainer.tokens.suppressed_ids) | set(trainer.tokens.eos_ids)
        self.candidates = [i for i in range(min(len(self.tokenizer), 300)) if i not in special]
        self.updates = 0
        self.calls: list[str] = []  # "sleep", "wake", "update", "generate": what the trainer asked, in order
        self.generate_calls = 0  # saved with checkpoints, as vLLM/SGLang save theirs

    def state_dict(self) -> dict:
        return {"generate_calls": self.generate_calls}

    def load_state_dict(self, state: dict) -> None:
        self.generate_calls = state["generate_calls"]
        self.calls.append(f"restored {self.generate_calls}")

    def calls_before_first_generate(self) -> list[str]:
        return self.calls[:self.calls.index("generate")] if "generate" in self.calls else list(self.calls)

    def generate(self, batch, sampling) -> Rollouts:
        self.calls.append("generate")
        self.generate_calls += 1
        ids: list[list[int]] = []
        for p in range(len(batch)):
            seed = zlib.crc32(f"{batch.samples[p].id}|{list(batch.prompt_ids[p])}".encode())
            for k in range(sampling.n):
                rng = random.Random(seed * 131 + k)
                length = rng.randint(1, sampling.max_new_tokens - 1)
                ids.append([rng.choice(self.candidates) for _ in range(length)] + [self.eos])
        return Rollouts(n=sampling.n, completion_ids=ids, finish_reasons=[FINISH_STOP] * len(ids),
                        texts=self.tokenizer.batch_decode(ids, skip_special_tokens=True))

    def update_weights(self, model) -> None:
        self.updates += 1
        self.calls.append("update")

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake(self) -> None:
        self.calls.append("wake")


class RecordingEngine:
    """Test double for a colocated engine's backend: keeps every (name, tensor) it is sent, on CPU."""

    def __init__(self):
        self.received: dict[str, torch.Tensor] = {}
        self.duplicates: list[str] = []

    def load(self, bucket) -> None:
        for name, tensor in bucket:
            if name in self.received:
                self.duplicates.append(name)
            self.received[name] = tensor.detach().cpu().clone()


def scripted_engine(cfg, deps):
    """A `ScriptedEngine`, inside the multi-turn engine when the config lists tools (the tools run for real)."""
    engine = ScriptedEngine(deps)
    if cfg.rollout.tools:
        from vlrft.rollout.multiturn import MultiTurnEngine

        return MultiTurnEngine.from_deps(cfg, deps, engine)
    return engine


def use_scripted_engine() -> None:
    """Make `Trainer` build a `ScriptedEngine` instead of the configured one (this process only)."""
    import vlrft.trainer.trainer as trainer_module

    trainer_module.make_engine = scripted_engine

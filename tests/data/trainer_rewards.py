"""Reward functions for trainer tests, loaded as 'tests/data/trainer_rewards.py:NAME'."""

import zlib


def token_parity(completions, completion_ids, **kwargs):
    """1 when the completion's first token id is even: varies within a group, deterministic given the ids."""
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


def constant_unless_yellow(completions, references, completion_ids, **kwargs):
    """Every prompt but the yellow ones always scores 1 (zero-variance groups); yellow ones score by token parity."""
    return [float(ids[0] % 2 == 0) if ref == "yellow" and ids else 1.0
            for ref, ids in zip(references, completion_ids)]


def text_hash(completions, **kwargs):
    """A deterministic pseudo-random score in [0, 1) from the completion text."""
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


def broken(completions, **kwargs):
    """Always raises, like a reward with a bug."""
    raise RuntimeError("grader crashed")


def reference_hash(completions, references, **kwargs):
    """A deterministic score in [0, 1) from the sample's reference answer: varies across prompts, not within a group."""
    return [zlib.crc32(str(ref).encode()) % 1000 / 1000 for ref in references]


_SCORED_BATCHES = []


def text_hash_then_sigterm_in_step_2(completions, **kwargs):
    """`text_hash`, and sends this process SIGTERM (a scheduler's preemption notice) while scoring step 2's batch."""
    import os
    import signal

    _SCORED_BATCHES.append(len(completions))
    if len(_SCORED_BATCHES) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return text_hash(completions)


def broken_on_rank_1(completions, **kwargs):
    """Raises on rank 1 only (RANK from torchrun), like a reward that fails on one rank's samples."""
    import os

    if os.environ.get("RANK") == "1":
        raise RuntimeError("grader crashed on rank 1")
    return [0.5] * len(completions)

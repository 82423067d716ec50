"""Prompt + completion token rows for training forwards, built from the prompts' own ids (no re-tokenization).

Layout of one batch: every prompt is left-padded to the batch's widest prompt `P`, every completion
right-padded to the widest completion `C`; completion token `t` of a row sits at column `P + t` and is
predicted by the hidden state at column `P + t - 1`. The rows refer to their prompt's visual inputs
by index (`row_prompt`), so a group of n completions shares one copy of the prompt's pixels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from vlrft.vision import VisualBatch


@dataclass(frozen=True)
class SequenceBatch:
    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C] float, 1 on generated tokens (the stop token included)
    prompt_width: int  # P
    row_prompt: tuple[int, ...]  # row -> sample of `visual`
    visual: VisualBatch  # the distinct prompts these rows use, each once
    # Multi-turn: images inside the completions (tool outputs), one sample per row, in order; None: none
    completion_visual: VisualBatch | None = None

    @property
    def has_completion_images(self) -> bool:
        return self.completion_visual is not None and self.completion_visual.num_images > 0

    def row_visual(self) -> VisualBatch:
        """One sample per row: its prompt's images, then those inside its completion."""
        prompts = self.visual.select(list(self.row_prompt))
        if not self.has_completion_images:
            return prompts
        return VisualBatch.concat([join_samples([prompts.select([i]), self.completion_visual.select([i])])
                                   for i in range(len(self))])

    @property
    def completion_width(self) -> int:
        return self.completion_mask.shape[1]

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "SequenceBatch":
        return SequenceBatch(self.input_ids.to(device), self.attention_mask.to(device),
                             self.completion_mask.to(device), self.prompt_width, self.row_prompt,
                             self.visual.to(device),
                             None if self.completion_visual is None else self.completion_visual.to(device))


def join_samples(parts: Sequence[VisualBatch]) -> VisualBatch:
    """Single-sample visual batches joined into ONE sample whose images come in the order of `parts`."""
    joined = VisualBatch.concat(list(parts))
    return dataclasses.replace(joined, images_per_sample=(sum(joined.images_per_sample),),
                               videos_per_sample=(sum(joined.videos_per_sample),))


def build_sequences(prompt_ids: Sequence[Sequence[int]], visual: VisualBatch, completion_ids: Sequence[Sequence[int]],
                    row_prompt: Sequence[int], pad_id: int, rows: Sequence[int] | None = None) -> SequenceBatch:
    """Rows `rows` (default all) of completions `completion_ids`, completion r belonging to prompt `row_prompt[r]`."""
    rows = list(range(len(completion_ids))) if rows is None else list(rows)
    distinct: dict[int, int] = {}
    for r in rows:
        distinct.setdefault(row_prompt[r], len(distinct))
    prompts = [prompt_ids[p] for p in distinct]
    width_p = max(len(p) for p in prompts)
    width_c = max(1, max(len(completion_ids[r]) for r in rows))
    ids = torch.full((len(rows), width_p + width_c), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion_mask = torch.zeros((len(rows), width_c), dtype=torch.float32)
    for i, r in enumerate(rows):
        prompt, completion = prompt_ids[row_prompt[r]], completion_ids[r]
        ids[i, width_p - len(prompt):width_p] = torch.as_tensor(prompt, dtype=torch.long)
        ids[i, width_p:width_p + len(completion)] = torch.as_tensor(completion, dtype=torch.long)
        attention[i, width_p - len(prompt):width_p + len(completion)] = 1
        completion_mask[i, :len(completion)] = 1.0
    return SequenceBatch(ids, attention, completion_mask, width_p,
                         tuple(distinct[row_prompt[r]] for r in rows), visual.select(list(distinct)))


def last_positions(mask: torch.Tensor) -> list[int]:
    """Per row of `mask` [B, C]: one past its last nonzero position (0 for an empty row).

    A row's extent, not its count of ones: a multi-turn completion mask has holes at the tool
    observations, so `mask.sum(1)` would end the row before its last sampled tokens.
    """
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.ne(0).long() * positions).amax(dim=1).tolist() if mask.shape[1] else [0] * mask.shape[0]


# A completion call's fixed cost, counted in token positions, when `width_classes` weighs another call
# against padding (kernel launches, per-layer overhead; a few dozen tokens' worth on CPU and GPU alike).
CALL_TOKENS = 32


def width_classes(lengths: Sequence[int], call_tokens: int = CALL_TOKENS) -> list[list[int]]:
    """Indices of `lengths` in classes of consecutive lengths (longest first), each to be padded only to its own
    longest: the fewest padded tokens + `call_tokens` per class (a dynamic programme over the cut points).

    The shared-prompt forward runs one completion call per class after the one prompt pass
    (`vlrft.models.actor.ActorVL`), so rows of very different lengths share a micro-batch (and
    their prompt) without padding the short ones to the longest.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    runs = cheapest_runs(len(order), lambda i, j: (j - i) * max(1, lengths[order[i]]) + call_tokens)
    return [order[i:j] for i, j in runs]


def cheapest_runs(n: int, cost: Callable[[int, int], float | None]) -> list[tuple[int, int]]:
    """Items 0..n-1 cut into consecutive runs [i, j) of the least total `cost(i, j)` (a dynamic programme over
    the cut points). `cost` None: neither [i, j) nor any longer run ending at j is allowed (runs ending at j are
    tried shortest first); a single item's cost must be a number."""
    best: list[float | None] = [0.0] + [None] * n  # best[j]: the least cost of the first j items
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            c = cost(i, j)
            if c is None:
                break
            total = best[i] + c
            if best[j] is None or total < best[j]:
                best[j], cut[j] = total, i
    runs, j = [], n
    while j > 0:
        runs.append((cut[j], j))
        j = cut[j]
    return runs[::-1]

"""Rows that stop leave a decoder's KV cache in halvings, not one copy of it per step where a row stopped."""

from __future__ import annotations

import torch


class HalvingRowsDecoder:
    """A decoder whose stopped rows are dropped only once at most half of its rows are still reported.

    Dropping rows copies the whole KV cache; dropping at every step where a row stopped copied it up to once per
    step, halvings copy about two caches per call (docs/decoding.md, "Rows that stop"). Until the next halving a
    stopped row is computed on, fed token 0, and not reported: the reported rows' arithmetic is unchanged.
    """

    def __init__(self, decoder, rows: int):
        self.decoder, self.rows = decoder, rows  # rows: how many `decoder` computes
        self.alive: torch.Tensor | None = None  # rows of `decoder` still reported (None: all of them)
        self.tokens: torch.Tensor | None = None  # a step's input for every row of `decoder`

    def keep(self, index: torch.Tensor) -> None:
        """Report only rows `index` of those reported so far."""
        alive = index if self.alive is None else self.alive.index_select(0, index)
        if 2 * alive.shape[0] <= self.rows:  # shapes only: no device sync
            self.decoder.keep(alive)
            self.rows, self.alive, self.tokens = alive.shape[0], None, None
        else:
            self.alive = alive
            if self.tokens is None:
                self.tokens = torch.zeros(self.rows, dtype=torch.long, device=alive.device)

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        if self.alive is None:
            return self.decoder.step(tokens, step)
        self.tokens.index_copy_(0, self.alive, tokens)
        return self.decoder.step(self.tokens, step).index_select(0, self.alive)

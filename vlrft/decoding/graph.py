"""Decode steps with the same shapes every time, replayed as one CUDA graph per decode call (the default on CUDA).

A graph replays fixed shapes on fixed memory, so every step keeps every row and attends over every preallocated
position (`LeanDecoder(fixed_shapes=True)`). `FixedRowsDecoder` is that row bookkeeping, eager (what the CPU tests
run); `CudaGraphDecoder` captures its step after WARMUP_STEPS warm-up steps and replays it. Why: docs/decoding.md.
"""

from __future__ import annotations

import contextlib

import torch

from vlrft.decoding.lean import LeanDecoder

WARMUP_STEPS = 2  # eager steps on a side stream before capture (lazy initialisation, allocator, cuBLAS workspaces)


class FixedRowsDecoder:
    """Keeps every row of a fixed-shape `LeanDecoder` in every step; `keep` only narrows which rows are reported."""

    def __init__(self, decoder: LeanDecoder):
        if not decoder.fixed_shapes:
            raise ValueError("FixedRowsDecoder needs LeanDecoder(..., fixed_shapes=True)")
        self.decoder = decoder
        rows = decoder.position.shape[0]
        device = decoder.position.device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # the step's input, every row
        self.alive = torch.arange(rows, device=device)  # rows still reported, in the caller's order

    def keep(self, index: torch.Tensor) -> None:
        """Report only rows `index` of those reported so far (the others stopped; they are still computed)."""
        self.alive = self.alive.index_select(0, index)

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """`tokens` [reported rows] in; hidden states of the reported rows out. Stopped rows repeat their last token."""
        self.tokens.index_copy_(0, self.alive, tokens)
        return self._run(step).index_select(0, self.alive)

    def _run(self, step: int) -> torch.Tensor:
        return self.decoder.step(self.tokens, step)


class CudaGraphDecoder(FixedRowsDecoder):
    """`FixedRowsDecoder` whose step is captured once as a CUDA graph and replayed for every token."""

    def __init__(self, decoder: LeanDecoder):
        super().__init__(decoder)
        state = decoder.state()
        # Under autocast no cast may be cached inside the capture (the weights' casts are the decoder's own copies);
        # the warm-up steps run in the capture's autocast state.
        dtype = decoder.compute_dtype

        def uncached():
            return (contextlib.nullcontext() if dtype is None
                    else torch.autocast("cuda", dtype=dtype, cache_enabled=False))

        side = torch.cuda.Stream(device=self.tokens.device)
        side.wait_stream(torch.cuda.current_stream(self.tokens.device))
        with torch.cuda.stream(side), uncached():
            for _ in range(WARMUP_STEPS):
                decoder.step(self.tokens, 0)
        torch.cuda.current_stream(self.tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's CUDA calls are barred during the capture, not a reward thread's (a reward
        # model scoring in another thread, or one left running after its timeout) that happens to run meanwhile.
        with uncached(), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.hidden = decoder.step(self.tokens, 0)  # recorded, not run: the output lives in the graph's pool
        decoder.restore(state)  # undo the warm-up steps (slot, positions, mask); their KV entries are masked again

    def _run(self, step: int) -> torch.Tensor:
        self.graph.replay()
        return self.hidden

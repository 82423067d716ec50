"""Which prompts each step trains on: a seeded shuffled order over epochs, split over ranks, resumable.

The global prompt stream is epoch 0's permutation, then epoch 1's, ... (each permutation drawn
from `(seed, epoch)`, so it never depends on how far a run got). Step k takes the next
`batch_size` prompts of the stream; rank r takes its contiguous share of them, and the trainer
repeats each prompt for its group on that rank, so groups stay whole. `state_dict` is a single
position in the stream, which resumes exactly, even with another batch size or number of ranks.
"""

from __future__ import annotations

import numpy as np

from vlrft.errors import UserError


class PromptSampler:
    """Deterministic prompt indices per step for one rank; see the module docstring."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1):
        if num_samples <= 0:
            raise UserError("the training data has no usable samples; check data.train_files (`vlrft data check`)")
        if batch_size <= 0 or world_size <= 0 or batch_size % world_size:
            raise UserError(f"prompts per step ({batch_size}) must be a positive multiple of the number of ranks "
                            f"({world_size}); adjust rollout.global_batch_completions")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.position = 0  # prompts of the global stream already handed out (all ranks together)
        self._cached_epoch, self._cached_order = -1, np.arange(0)

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from."""
        return self.position // self.num_samples

    @property
    def steps_per_epoch(self) -> float:
        return self.num_samples / self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed % 2**63, epoch])
                self._cached_order = rng.permutation(self.num_samples)
            else:
                self._cached_order = np.arange(self.num_samples)
            self._cached_epoch = epoch
        return self._cached_order

    def next_indices(self) -> list[int]:
        """This rank's prompt indices for the next step; epochs roll over (a step may straddle two)."""
        per_rank = self.batch_size // self.world_size
        start = self.position + self.rank * per_rank
        positions = np.arange(start, start + per_rank)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(per_rank, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._order(int(epoch))[offsets[mask]]
        self.position += self.batch_size
        return out.tolist()

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "num_samples": self.num_samples,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position; refuses a state saved for other data or another seed."""
        for key in ("num_samples", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise UserError(f"cannot resume the prompt order: the checkpoint was saved with {key}={state.get(key)!r} "
                                f"but this run has {key}={getattr(self, key)!r}; use the same data and train.seed, "
                                "or start without train.resume")
        self.position = int(state["position"])

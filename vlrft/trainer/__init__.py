"""The SPMD trainer: experience making, the step loop, checkpoints and evaluation."""

from vlrft.trainer.trainer import Trainer

__all__ = ["Trainer"]

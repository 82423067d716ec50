"""The SPMD trainer: experience making, the step loop, checkpoints and evaluation.

`from vlrft.trainer import Trainer` is resolved lazily so that light modules of this package
(e.g. `vlrft.trainer.sequences`, used by the models) import without the whole trainer.
"""


def __getattr__(name: str):
    if name == "Trainer":
        from vlrft.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(name)


__all__ = ["Trainer"]

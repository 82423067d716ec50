"""Moved to `vlrft.batch` (the models use it, and they sit below the trainer). Kept only so branches
written against the old path still import; import from `vlrft.batch`."""

from vlrft.batch import SequenceBatch, build_sequences  # noqa: F401

"""One run per output folder: refuse to mix two runs, clear a folder only when asked, tag checkpoints with a run id.

A second run started into a folder that already holds one would otherwise truncate its metrics and
prune its checkpoints. So an output folder holding a run's files is refused unless the user says what to do:
continue it (`train.resume=auto` or a checkpoint inside that folder) or start over
(`train.overwrite=true`, which deletes exactly the files a run writes, nothing else).

Every checkpoint records the id of the run lineage that wrote it (a fresh run draws one; a resumed
run keeps its checkpoint's), and keep-last pruning only ever deletes checkpoints of that lineage.

With several processes the folder must be one folder for all of them (a file system every node
sees): every rank writes its part of a checkpoint into a folder rank 0 creates and renames. A
folder on each node's own disk is refused at start (`check_shared`), not at the first checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from vlrft.errors import ConfigError, UserError

# What a run writes into its output folder; `train.overwrite=true` deletes these and nothing else.
RUN_FILES = ("config.yaml", "metrics.jsonl", "completions.jsonl", "completions", "tensorboard", "checkpoints",
             "wandb")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def check_output_dir(output_dir: str | Path, resume: str, resume_from: Path | None, overwrite: bool) -> list[Path]:
    """Raise a `UserError` when starting here would mix with or destroy another run; returns what overwrite clears.

    Resuming (`resume=auto`, or a checkpoint inside this folder) continues the run that is there. A fresh
    start (`resume=none`, or a checkpoint from another folder) needs an empty folder, or `overwrite`.
    """
    folder = Path(output_dir)
    if overwrite and resume != "none":
        raise ConfigError(f"config: train.overwrite=true and train.resume={resume!r} contradict each other; "
                          "resume the run that is there or overwrite it, not both")
    continuing = resume == "auto" or (resume_from is not None and _inside(resume_from, folder))
    if continuing or not folder.is_dir():
        return []
    # Other files (e.g. the demo's base model built inside the folder) are not a run and are never touched.
    found = [folder / name for name in RUN_FILES if (folder / name).exists()]
    if not found or overwrite:
        return found
    shown = ", ".join(p.name for p in found)
    raise UserError(f"train.output_dir='{folder}' is not empty (holds {shown} of a run); continue that run with "
                    "train.resume=auto, start over with train.overwrite=true (deletes its metrics, TensorBoard "
                    "logs and checkpoints), or pick another train.output_dir")


def clear(paths: list[Path]) -> None:
    """Delete the run files `check_output_dir` listed (main rank only)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


# How long a rank looks again for a file another rank has just created before calling it missing: a network file
# system may answer from a cached "no such file" for a while (listing the folder refreshes it).
VISIBILITY_WAIT_S = 20.0


def appears(path: Path, seconds: float = VISIBILITY_WAIT_S) -> bool:
    """Whether `path` exists, looking again (the folder listed, once a second) for up to `seconds`."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        with contextlib.suppress(OSError):
            os.listdir(path.parent)
        time.sleep(1.0)
    return True


def ranks_without(strategy, present: bool) -> list[str]:
    """"rank R on HOST" for each rank whose `present` is False (every rank calls this together)."""
    answers = strategy.all_gather_object((strategy.rank, socket.gethostname(), bool(present)))
    return [f"rank {rank} on {host}" for rank, host, ok in answers if not ok]


def check_shared(strategy, folder: Path, run_id: str) -> None:
    """Refuse an output folder that is not the same folder for every rank (e.g. each node's local disk).

    Rank 0 creates a marker file in it and every rank looks for it; a single process has nothing to check.
    """
    if strategy.world_size == 1:
        return
    marker = Path(folder) / f".vlrft-shared-{run_id}"
    if strategy.is_main:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    strategy.barrier()
    missing = ranks_without(strategy, appears(marker))  # a collective: every rank has looked once it returns
    if strategy.is_main:
        marker.unlink(missing_ok=True)
    if missing:
        raise UserError(f"train.output_dir='{folder}' is not the same folder on every rank: {', '.join(missing)} "
                        "cannot see what rank 0 writes there. Checkpoints are written by all ranks into one "
                        "folder; put train.output_dir on a file system every node mounts (NFS, Lustre, ...)")

"""Checkpoints that resume exactly: weights (HF format), optimizer, scheduler, every rank's RNG, trainer state.

A checkpoint is written into a temporary folder and renamed into place only when complete, so a
crash while saving never touches the previous one; older ones of the same run lineage (the `run_id` in
`trainer_state.json`) are pruned after that (keep-last-k), renamed first so a cut-short delete is never mistaken
for a checkpoint.
Layout of `<output_dir>/checkpoints/step_<k>/`: `model/` (save_pretrained + processor; for LoRA the
adapter), `scheduler.pt`, `trainer_state.json`, `rng/rank<r>.pt`, and what the strategy writes for
the optimizer states (single/DDP: `optimizer.pt`, `critic.pt` for PPO; FSDP2: `sharded/`, a
`torch.distributed.checkpoint` folder that any number of processes can read back).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrft.errors import UserError

PREFIX = "step_"
STATE_FILE = "trainer_state.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def lineage_checkpoints(output_dir: str | Path, run_id: str | None) -> list[Path]:
    """Complete checkpoints written by run lineage `run_id`, oldest first: the only ones keep-last may prune."""
    return [c for c in list_checkpoints(output_dir) if _run_id_of(c) == run_id]


def _run_id_of(checkpoint: Path) -> str | None:
    try:
        return load_trainer_state(checkpoint).get("run_id")
    except (OSError, ValueError):
        return "<unreadable>"  # never equal to a real id: such a checkpoint is never pruned


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """The checkpoint folder `train.resume` names: "none", "auto" (latest in output_dir, if any) or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"train.resume='{resume}' is not a complete checkpoint (no {STATE_FILE}); pass a "
                        f"'{checkpoint_root(output_dir)}/{PREFIX}<k>' folder, 'auto' or 'none'")
    return path


def rng_state() -> dict[str, Any]:
    """This rank's generators: Python, NumPy, CPU torch and its own GPU's (the one `torch.cuda.set_device` chose), so
    a checkpoint resumes on machines with another number of GPUs."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved, device = state["cuda"], torch.cuda.current_device()
        if isinstance(saved, (list, tuple)):  # written by earlier versions: every visible GPU's state
            saved = saved[device] if device < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved, device)


def save_checkpoint(output_dir: str | Path, step: int, *, strategy, parts: dict, hf_model, processor, scheduler,
                    trainer_state: dict, keep_last: int = 2) -> Path:
    """Write checkpoint `step` atomically on all ranks (every rank must call this).

    The strategy writes the models and optimizers (`parts`: "policy", optionally "critic"); this
    adds the scheduler, every rank's RNG and the trainer state.
    """
    root = checkpoint_root(output_dir)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}"
    if strategy.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    strategy.barrier()
    torch.save(rng_state(), tmp / "rng" / f"rank{strategy.rank}.pt")
    strategy.save_checkpoint(tmp, parts, hf_model, processor)
    strategy.barrier()
    if strategy.is_main:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=1))
        _fsync_tree(tmp)
    strategy.barrier()
    if strategy.is_main:
        if final.exists():  # the same step saved again (a resumed run): replace it
            old = root / f".old-{PREFIX}{step}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        for stale in lineage_checkpoints(output_dir, trainer_state.get("run_id"))[:-keep_last] if keep_last > 0 else []:
            _delete(stale)
        finish_interrupted_deletions(output_dir)
    strategy.barrier()
    return final


def finish_interrupted_deletions(output_dir: str | Path) -> None:
    """Remove checkpoints whose pruning a crash cut short (renamed `.deleting-*`, never resumed from)."""
    for leftover in checkpoint_root(output_dir).glob(".deleting-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _delete(checkpoint: Path) -> None:
    """Rename first, then delete: a crash mid-delete never leaves a half-deleted checkpoint that looks complete."""
    hidden = checkpoint.parent / f".deleting-{checkpoint.name}"
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(checkpoint, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """Flush file contents to disk before the rename makes the checkpoint visible."""
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def load_trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / STATE_FILE).read_text())


def load_rank_rng(checkpoint: Path, rank: int, required: bool = True) -> None:
    """This rank's saved random state; a rank the checkpoint did not have keeps its seeded state unless `required`."""
    path = checkpoint / "rng" / f"rank{rank}.pt"
    if not path.is_file() and not required:
        return
    if not path.is_file():
        raise UserError(f"checkpoint '{checkpoint}' has no RNG state for rank {rank}; resume with the same number "
                        "of processes it was saved with")
    set_rng_state(torch.load(path, weights_only=False))

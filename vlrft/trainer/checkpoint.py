"""Checkpoints that resume exactly: weights (HF format), optimizer, scheduler, every rank's RNG, trainer state.

A checkpoint is written into a temporary folder and renamed into place only when complete, so a
crash while saving never touches the previous one; older ones of the same run lineage (the `run_id` in
`trainer_state.json`) are pruned after that (keep-last-k), renamed first so a cut-short delete is never mistaken
for a checkpoint.
Layout of `<output_dir>/checkpoints/step_<k>/`: `model/` (save_pretrained + processor; for LoRA the
adapter), `scheduler.pt`, `trainer_state.json`, `rng/rank<r>.pt`, and what the strategy writes for
the optimizer states (single/DDP: `optimizer.pt`, `critic.pt` for PPO; FSDP2: `sharded/`, a
`torch.distributed.checkpoint` folder that any number of processes can read back).

A checkpoint is complete when its `manifest.json` (every file's size and CRC-32, `vlrft.trainer.manifest`) is there:
it is written last. A resume checks the files against it; a damaged newest checkpoint is named in one line and
refused, or (`train.resume_fallback`) skipped for the newest complete one before it. Checkpoints written before
manifests existed are resumed with a warning line (only their `trainer_state.json` can be checked). Every file is
read back with `vlrft.safe_load` (data only: a planted pickle is refused, never run).

Checkpoints are ordered by when they were written (`saved_at`), not by step: a run resumed from an older
checkpoint writes steps the abandoned continuation also wrote, and `resume=auto` and keep-last must take the
resumed run's as the newest. What a crash leaves (`.tmp-*` half-written, `.old-*` mid-replace, `.deleting-*`
mid-prune) is cleared after every save and when a run resumes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrft.errors import UserError
from vlrft.safe_load import load_torch
from vlrft.trainer import manifest
from vlrft.trainer.manifest import MANIFEST

PREFIX = "step_"
STATE_FILE = "trainer_state.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints (a manifest or a trainer state; `check_damage` says whether one is whole), in the order they were
    written (oldest first)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
             and ((p / STATE_FILE).is_file() or (p / MANIFEST).is_file())]
    return sorted(found, key=_written_at)


def _written_at(checkpoint: Path) -> tuple[float, int]:
    """(when it was written, step): `saved_at` from its manifest, else its state. Checkpoints of earlier versions
    have none: they come first, by step (they were written before any that has one; a copy would change their
    files' times). One with neither readable is damaged: it sorts last, so `resume=auto` names it."""
    step = int(checkpoint.name[len(PREFIX):])
    saved = manifest.saved_at(checkpoint)
    if saved is None:
        try:
            saved = load_trainer_state(checkpoint).get("saved_at") or 0.0
        except (OSError, ValueError):
            saved = float("inf")
    return float(saved), step


def lineage_checkpoints(output_dir: str | Path, run_id: str | None) -> list[Path]:
    """Complete checkpoints written by run lineage `run_id`, oldest first: the only ones keep-last may prune."""
    return [c for c in list_checkpoints(output_dir) if _run_id_of(c) == run_id]


def _run_id_of(checkpoint: Path) -> str | None:
    try:
        return load_trainer_state(checkpoint).get("run_id")
    except (OSError, ValueError):
        return "<unreadable>"  # never equal to a real id: such a checkpoint is never pruned


def resolve_resume(resume: str, output_dir: str | Path, fallback: bool = False, say=None) -> Path | None:
    """The checkpoint folder `train.resume` names: "none", "auto" (the last written in output_dir, if any) or a
    path, checked against its manifest (`check_damage`). A damaged one is refused in one line (`UserError`); with
    `fallback` (`train.resume_fallback`, auto only) `say` names it and the newest whole one before it is taken."""
    say = say or (lambda text: print(text, flush=True))
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not ((path / STATE_FILE).is_file() or (path / MANIFEST).is_file()):
            raise UserError(f"train.resume='{resume}' is not a complete checkpoint (no {STATE_FILE}); pass a "
                            f"'{checkpoint_root(output_dir)}/{PREFIX}<k>' folder, 'auto' or 'none'")
        candidates = [path]
    else:
        candidates = list_checkpoints(output_dir)[::-1]
    for checkpoint in candidates:
        damage = check_damage(checkpoint)
        if damage is None:
            if not (checkpoint / MANIFEST).is_file():
                say(f"checkpoint {checkpoint} has no {MANIFEST} (written by a vlrft before checkpoints had one): "
                    "resuming from it without checking its files")
            return checkpoint
        if not fallback or resume != "auto":
            how = ("set train.resume_fallback=true to resume from the newest complete checkpoint before it, or move "
                   "it out of the checkpoints folder" if resume == "auto" else "resume from another checkpoint")
            raise UserError(f"checkpoint {checkpoint} is damaged: {damage}; {how}")
        say(f"checkpoint {checkpoint} is damaged: {damage}; skipping it (train.resume_fallback=true)")
    if candidates:
        raise UserError(f"no complete checkpoint in '{checkpoint_root(output_dir)}': every one is damaged (above); "
                        "start without train.resume, or with train.overwrite=true")
    return None


def checkpoint_to_resume(resume: str, output_dir: str | Path, fallback: bool, say) -> Path | None:
    """The checkpoint a run resumes from (rank 0 decides); first, what a crash left in the folder is cleared: a save
    killed between its renames may have moved the newest checkpoint aside."""
    if resume != "none":
        clear_crash_leftovers(output_dir)
    return resolve_resume(resume, output_dir, fallback, say)


def check_damage(checkpoint: Path) -> str | None:
    """What is wrong with `checkpoint` (a file missing, truncated or changed, by its manifest), or None. One written
    before manifests existed has only its trainer state checked; one whose state says it had a manifest (format)
    and has none is damaged."""
    try:
        state = load_trainer_state(checkpoint)
    except (OSError, ValueError) as exc:
        state = exc
    if (checkpoint / MANIFEST).is_file() or (isinstance(state, dict) and "manifest" in state):
        return manifest.verify(checkpoint)
    if isinstance(state, Exception):
        return f"{STATE_FILE} cannot be read ({' '.join(str(state).split())[:120]})"
    return None


def nothing_to_do(checkpoint: Path, step: int, total_steps: int) -> str:
    return (f"nothing to do: checkpoint {checkpoint} is at step {step} and train.total_steps={total_steps}; raise "
            "train.total_steps to train on from it")


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
                    trainer_state: dict, keep_last: int = 2, export_hf: bool = True,
                    hf_dtype: torch.dtype | None = None) -> Path:
    """Write checkpoint `step` atomically on all ranks (every rank must call this).

    The strategy writes the models and optimizers (`parts`: "policy", optionally "critic"), and `model/` (where its
    own files hold the weights, only when `export_hf`, in `hf_dtype`); this adds the scheduler, every rank's RNG
    and the trainer state.
    """
    root = checkpoint_root(output_dir)
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}"
    writing = _WriteGuard(strategy, step, tmp, lambda: _needed_bytes(output_dir, strategy, parts, hf_model))
    with writing:
        if strategy.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
    writing.agree()
    with writing:
        torch.save(rng_state(), tmp / "rng" / f"rank{strategy.rank}.pt")
        strategy.save_checkpoint(tmp, parts, hf_model, processor, export_hf=export_hf, hf_dtype=hf_dtype)
    writing.agree()
    saved_at = time.time()
    with writing:
        if strategy.is_main:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            state = {"step": step, **trainer_state, "saved_at": saved_at, "manifest": manifest.FORMAT}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    writing.agree()
    # Every rank checksums its share of the files; rank 0 writes the manifest last: only then is it complete.
    names = strategy.broadcast_object(manifest.files_in(tmp) if strategy.is_main else None)
    mine: dict = {}
    with writing:
        mine = manifest.describe(tmp, names[strategy.rank::strategy.world_size])
    shares = strategy.all_gather_object(mine)
    with writing:
        if strategy.is_main:
            manifest.write(tmp, {name: entry for share in shares for name, entry in share.items()}, saved_at)
            _fsync_tree(tmp)
    writing.agree()
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
        clear_crash_leftovers(output_dir)
    strategy.barrier()
    return final


# What a full disk looks like from the writers: OSError ENOSPC / EDQUOT (Python's own writes), torch.save's
# "[enforce fail at inline_container.cc] . unexpected pos N vs M" or "file write failed" (its C++ stream writer, which
# drops the errno), safetensors' "IoError(Os { code: 28, kind: StorageFull ... })".
_WRITE_FAILED = ("unexpected pos", "file write failed", "No space left", "StorageFull", "Disk quota exceeded")


def write_failure(exc: BaseException) -> bool:
    """Whether `exc` is a failed file write (a full disk, a quota, an I/O error), not a bug."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG)
    return any(text in str(exc) for text in _WRITE_FAILED)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.1f} MB"


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _needed_bytes(output_dir: str | Path, strategy, parts: dict, hf_model) -> tuple[int, str]:
    """(bytes a checkpoint takes, how that was found): the last complete one's size, else an estimate from the
    weights (the exported model plus each trained part's weights and optimizer state on every rank)."""
    done = list_checkpoints(output_dir)
    if done:
        with contextlib.suppress(OSError):
            return _tree_bytes(done[-1]), f"the size of {done[-1].name}"

    def tensor_bytes(tree) -> int:
        if isinstance(tree, torch.Tensor):
            return tree.numel() * tree.element_size()
        if isinstance(tree, dict):
            return sum(tensor_bytes(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return sum(tensor_bytes(v) for v in tree)
        return 0

    total = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    for part in parts.values():
        local = sum(p.numel() * p.element_size() for p in part.module.parameters() if p.requires_grad)
        local += tensor_bytes(getattr(part.optimizer, "state", {}))
        total += local * (strategy.world_size if strategy.reshards_checkpoints else 1)
    return total, "estimated from the weights and optimizer state"


class _WriteGuard:
    """Turns a failed write of checkpoint `step` (a full disk above all) into one `UserError` on every rank.

    A rank whose write failed records it; `agree()` (a collective, where a barrier stood) tells every rank, so no
    rank waits for one that stopped. The half-written `.tmp-step_k` is removed (its space back); the previous
    checkpoint stays the one to resume from."""

    def __init__(self, strategy, step: int, tmp: Path, needed):
        self.strategy, self.step, self.tmp, self.needed = strategy, step, tmp, needed
        self.failure: BaseException | None = None

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception) or not write_failure(exc):
            return False
        self.failure = exc
        return True

    def agree(self) -> None:
        failed = self.strategy.all_reduce(torch.tensor([float(self.failure is not None)]), "max").item() > 0
        if not failed:
            return
        folder = self.tmp.parent  # <output_dir>/checkpoints
        needed, how = self.needed()
        if self.strategy.is_main:
            shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        except OSError:
            free = None
        full = self.failure is None or (isinstance(self.failure, OSError) and self.failure.errno in
                                        (errno.ENOSPC, errno.EDQUOT)) or "No space" in str(self.failure) \
            or "StorageFull" in str(self.failure) or (free is not None and free < needed)
        cause = ("another rank could not write its part" if self.failure is None
                 else " ".join(str(self.failure).split())[:160])
        space = f"{_gb(free)} free there" if free is not None else "free space unknown"
        what = "the disk is full" if full else "a write failed"
        raise UserError(f"checkpoint step {self.step}: {what} while writing into '{folder}' ({cause}); the checkpoint "
                        f"needs about {_gb(needed)} ({how}), {space}. Nothing of step {self.step} was kept; free "
                        "space there (or move train.output_dir, or lower train.keep_last) and continue with "
                        "train.resume=auto from the last checkpoint")


def clear_crash_leftovers(output_dir: str | Path) -> None:
    """Finish what a crash cut short; call it only while no checkpoint is being written.

    - `.deleting-*`: a prune (renamed first, never resumed from): removed;
    - `.old-step_k`: a checkpoint being replaced by a new save of the same step. When `step_k` is missing the crash
      came between the two renames, which start only once the new save is complete and synced to disk: the new
      one (`.tmp-step_k`) takes its place, else (nothing complete there) the old one goes back. Then it is removed;
    - `.tmp-step_k`: a save that never completed (a preemption's SIGKILL mid-save): removed. Each is a whole
      checkpoint's size, and nothing else would ever delete it.
    """
    root = checkpoint_root(output_dir)
    for old in root.glob(f".old-{PREFIX}*"):
        step = old.name[len(".old-"):]
        kept, new = root / step, root / f".tmp-{step}"
        if not kept.exists() and (new / MANIFEST).is_file():
            os.replace(new, kept)
        elif not kept.exists() and (old / STATE_FILE).is_file():
            os.replace(old, kept)
        shutil.rmtree(old, ignore_errors=True)
    for leftover in [*root.glob(".deleting-*"), *root.glob(f".tmp-{PREFIX}*")]:
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
    set_rng_state(load_torch(path, what=f"checkpoint RNG state of rank {rank}"))


def load_scheduler_state(checkpoint: Path) -> dict:
    return load_torch(checkpoint / "scheduler.pt", what="checkpoint scheduler state")

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
import errno
import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from vlrft.errors import ConfigError, UserError, write_failed

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
    """Delete the run files `check_output_dir` listed (main rank only); one that cannot be deleted: a `UserError`."""
    for path in paths:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            raise write_failed(path, exc) from exc


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


# ---------------------------------------------------------------------------------------------- one live run

HOLD_FILE = ".vlrft-run.lock"
# The holding run rewrites its heartbeat this often; a hold whose heartbeat is older than STALE_AFTER_S is a dead
# run's wherever it ran. On the holder's own host the pid answers sooner (a dead pid: stale at once).
HEARTBEAT_S = 30.0
STALE_AFTER_S = float(os.environ.get("VLRFT_HOLD_STALE_S", 600.0))


def _stat_field(pid: int, index: int) -> str | None:
    """Field `index` of /proc/PID/stat counted after the command name (0: state, 19: start time), None where
    unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: /proc/PID/stat field 22, in clock ticks since boot), to tell a reused pid
    from the run that held the folder; None where unknown."""
    return _stat_field(pid, 19)


def _process_state(pid: int) -> str | None:
    """The one-letter state in /proc (R, S, T, Z, ...), or None where /proc does not say."""
    return _stat_field(pid, 0)


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    if _process_state(pid) == "Z":  # ended, not yet reaped by its parent: not a live run
        return False
    now = _process_start(pid)
    return started is None or now is None or now == started


class RunHold:
    """The output folder's hold: `<output_dir>/.vlrft-run.lock`, one live run at a time.

    The main rank takes it before it reads or clears anything in the folder, and gives it back when the run ends
    (a SIGKILL leaves it behind: a stale hold). It records the holder's host, pid, process start time, run start
    and a heartbeat the holder rewrites every HEARTBEAT_S. Another run is refused while the hold is live:
    - on the holder's host: its pid is alive (and is the same process: its start time matches);
    - elsewhere (the folder on a shared file system, the holder on another node, whose pids mean nothing here):
      its heartbeat is younger than STALE_AFTER_S (10 min; VLRFT_HOLD_STALE_S). The clocks of the nodes are
      compared, so they must agree to well within that (NTP).
    A stale hold is taken over with a message. Taking it is an exclusive create, and a takeover replaces the file
    and reads it back: two runs starting at the same instant over a stale hold cannot both go on unnoticed on one
    file system. The same process taking its own hold again (a resumed Trainer in one Python process) is allowed.
    """

    def __init__(self, folder: str | Path, message=print):
        self.folder = Path(folder)
        self.path = self.folder / HOLD_FILE
        self.message = message
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False
        self.created: list[Path] = []

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
                "started": time.time(), "heartbeat": time.time(), "token": self.token}

    def _write(self, record: dict, exclusive: bool) -> bool:
        data = json.dumps(record).encode()
        if exclusive:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        tmp = self.path.with_name(f"{HOLD_FILE}.{self.token}")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        return True

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # torn or unreadable: judged by the file's age

    def live_reason(self, hold: dict) -> str | None:
        """Why `hold` belongs to a live run (None: stale)."""
        host, pid = hold.get("host"), hold.get("pid")
        if host == socket.gethostname() and isinstance(pid, int):
            if pid == os.getpid():
                return None  # this process's own hold
            return "its process is alive" if _alive(pid, hold.get("process_start")) else None
        beat = hold.get("heartbeat")
        if not isinstance(beat, (int, float)):
            try:
                beat = self.path.stat().st_mtime
            except OSError:
                return None
        age = time.time() - beat
        if age < STALE_AFTER_S:
            return (f"its heartbeat is {age:.0f} s old (a hold is stale after {STALE_AFTER_S:.0f} s without one, "
                    "VLRFT_HOLD_STALE_S)")
        return None

    def acquire(self) -> None:
        """Take the hold, or raise a `UserError` naming the live run that has it (or what makes the folder unusable)."""
        self.created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]  # removed if left empty
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._take()
        except OSError as exc:  # not a folder, read-only, /proc or /sys: one line naming the setting, not a traceback
            self._remove_created()
            raise unusable_folder(self.folder, exc) from exc
        time.sleep(0.05)  # a racing takeover wrote after us: the file says who won
        if (self.read() or {}).get("token") != self.token:
            raise UserError(f"train.output_dir='{self.folder}' was taken by another run starting at the same time; "
                            "pick another train.output_dir")
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="vlrft-run-hold", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        """Write the hold file: an exclusive create, or a takeover of a stale hold (a live one: a `UserError`)."""
        for _ in range(3):
            if self._write(self._record(), exclusive=True):
                break
            hold = self.read()
            if hold is None:  # released meanwhile
                continue
            reason = self.live_reason(hold)
            if reason is not None:
                raise UserError(f"train.output_dir='{self.folder}' is in use by a live run: pid {hold.get('pid')} on "
                                f"host {hold.get('host')}, started {_when(hold.get('started'))} ({reason}). Wait for "
                                "it to end, stop it, or pick another train.output_dir")
            self._write(self._record(), exclusive=False)
            if hold.get("pid") != os.getpid() or hold.get("host") != socket.gethostname():
                self.message(f"{self.folder}: took over the hold of a run that is gone (pid {hold.get('pid')} on "
                             f"host {hold.get('host')}, started {_when(hold.get('started'))})")
            break
        else:
            raise UserError(f"train.output_dir='{self.folder}': could not take {HOLD_FILE}; another run is starting "
                            "there at the same time")

    def _remove_created(self) -> None:
        for folder in self.created:  # only when empty: a run refused before it wrote anything leaves no folder
            with contextlib.suppress(OSError):
                folder.rmdir()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            hold = self.read()
            if not hold or hold.get("token") != self.token:
                return  # taken over (we were judged dead): nothing more to refresh
            with contextlib.suppress(OSError):
                self._write({**hold, "heartbeat": time.time()}, exclusive=False)

    def release(self) -> None:
        """Give the hold back (only ours: a run that took over a hold it judged stale keeps it)."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if (self.read() or {}).get("token") == self.token:
            with contextlib.suppress(OSError):
                self.path.unlink()
        self._remove_created()


def unusable_folder(folder: Path, exc: OSError) -> UserError:
    """The one-line error for an output folder that cannot be created or written: what is wrong and the way out."""
    culprit = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    top = Path(os.path.abspath(folder)).parts[1:2]
    if culprit is not None:
        what = ("is a file or device, not a folder" if culprit == folder else
                f"has a file or device in its path ({culprit})")
    elif top and top[0] in ("proc", "sys", "dev"):
        what = f"is inside /{top[0]}, a system file system that cannot hold a run's files ({exc.strerror or exc})"
    elif exc.errno == errno.EROFS:
        what = "is on a read-only file system"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        what = f"cannot be written: permission denied for {exc.filename or folder}"
    else:
        what = f"cannot be created or written ({exc.strerror or exc})"
    return UserError(f"train.output_dir='{folder}' {what}; set train.output_dir to a folder on a writable disk "
                     "(e.g. train.output_dir=runs/my-run)")


def _when(started) -> str:
    if not isinstance(started, (int, float)):
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))

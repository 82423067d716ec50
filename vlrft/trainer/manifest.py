"""A checkpoint's manifest: every file it holds, with its size and CRC-32, written last.

A checkpoint is complete only when `manifest.json` is there: it is written after every other file (atomically: a
temporary file, fsynced, renamed), so a save cut short has none. A resume checks every file the manifest lists
against it: a file missing, shorter or longer (truncated, partly copied) or with other bytes (a bad disk, a bad
copy) makes the checkpoint damaged, named in one line by `verify`. Files added later (DeepSpeed's universal
conversion, written next to the original on a resume with another number of processes) are not checked.

CRC-32 (zlib), not SHA-256: it finds truncation and corruption, which is what this is for (anyone who can write a
checkpoint can rewrite its manifest too; what a file may hold is `vlrft.safe_load`'s job), at 2.6 GB/s per core
against SHA-256's 0.86 GB/s (measured on a 2-core CPU build machine with 400 MB of random bytes). Files are
checksummed on several threads (zlib releases the GIL); at save time every rank checksums its share of the files.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 16 << 20


def files_in(folder: Path) -> list[str]:
    """Every file under `folder` but the manifest, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(".manifest"))


def crc32(path: Path) -> str:
    value = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _threads(n: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus, n))


def describe(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"size", "crc32"}} of `names` (paths relative to `folder`)."""
    def one(name: str) -> tuple[str, dict]:
        path = folder / name
        return name, {"size": path.stat().st_size, "crc32": crc32(path)}

    with ThreadPoolExecutor(_threads(len(names))) as pool:
        return dict(pool.map(one, names))


def write(folder: Path, files: dict[str, dict], saved_at: float) -> None:
    """Write `folder/manifest.json` atomically, the checkpoint's last file."""
    tmp = folder / f".{MANIFEST}.tmp"
    with tmp.open("w") as handle:
        json.dump({"format": FORMAT, "saved_at": saved_at, "files": dict(sorted(files.items()))}, handle, indent=0)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST)


def read(folder: Path) -> dict | None:
    """The manifest, None when the folder has none; `ValueError` when it cannot be read."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text())
        if not isinstance(found, dict) or not isinstance(found.get("files"), dict):
            raise ValueError("no 'files' table")
        return found
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{MANIFEST} cannot be read ({' '.join(str(exc).split())[:120]})") from None


def saved_at(folder: Path) -> float | None:
    try:
        found = read(folder)
    except ValueError:
        return None
    return float(found["saved_at"]) if found and found.get("saved_at") is not None else None


def verify(folder: Path) -> str | None:
    """What is wrong with checkpoint `folder` by its manifest (the first file found wrong), or None when every file
    it lists is there with its size and checksum. A folder without a manifest is for the caller to judge."""
    try:
        found = read(folder)
    except ValueError as exc:
        return str(exc)
    if found is None:
        return f"{MANIFEST} is missing"
    files = found["files"]
    for name, entry in files.items():  # sizes first: a truncated file is found without reading anything
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("size"):
            return f"{name} has {size} bytes where {entry.get('size')} were written (truncated or overwritten)"
    sums = describe(folder, list(files))
    for name, entry in files.items():
        if sums[name]["crc32"] != entry.get("crc32"):
            return f"{name} does not match its checksum (its bytes changed after the save: a bad disk or copy)"
    return None


def reseal(folder: Path) -> None:
    """Describe `folder`'s files anew (keeping its `saved_at`): after editing a checkpoint on purpose (a test
    planting a file, a hand-repaired trainer state), so it resumes as complete."""
    try:
        saved = json.loads((folder / "trainer_state.json").read_text()).get("saved_at")
    except (OSError, ValueError):
        saved = saved_at(folder)
    write(folder, describe(folder, files_in(folder)), saved)

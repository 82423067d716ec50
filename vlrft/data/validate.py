"""Check every sample's media before training, so a bad image stops the run at step 0, not at step k.

`find_bad_media(samples, limits)` decodes each image once (threads: PIL releases the GIL while
decoding) with the same loader and limits training uses, checks that frame lists decode and that
video files open with a frame count and decode their first frame, and returns the problems found.
Images and video files that passed are remembered in a small SQLite cache keyed by a fingerprint
(path + size + mtime, or a hash of inline bytes, plus the limits), so a re-run skips them. The cache
lives in `$VLRFT_CACHE_DIR` (default `~/.cache/vlrft`).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlrft.data.media import MediaError, MediaLimits, check_video_file, load_image, local_path, not_a_file_reason
from vlrft.data.sample import Sample

DECODER_VERSION = "1"  # bump when vlrft.data.media decodes differently, to invalidate cached results


@dataclass(frozen=True)
class MediaProblem:
    """One unusable media reference: which sample (index into the list checked), which field, why."""

    index: int
    source: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}, field '{self.field}': {self.reason}"


def cache_dir() -> Path:
    return Path(os.environ.get("VLRFT_CACHE_DIR") or Path.home() / ".cache" / "vlrft")


def cache_file(folder: Path) -> Path:
    """The cache file of this process. Under torchrun each rank checks its own share and keeps its own file: one
    writer per SQLite file, also where the folder is on a network file system every node mounts."""
    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    return folder / ("media_ok.sqlite" if rank is None else f"media_ok.rank{rank}.sqlite")


def _fingerprint(ref: Any, limits: MediaLimits) -> str | None:
    """A key that changes when the image (or the limits) change; None for in-memory images (not cached)."""
    tag = f"{DECODER_VERSION}|{limits.max_source_pixels}|{limits.max_aspect_ratio}"
    if isinstance(ref, dict):
        for key in ("image", "url", "bytes", "path"):
            if ref.get(key) is not None:
                return _fingerprint(ref[key], limits)
        return None
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return f"bytes:{hashlib.blake2b(bytes(ref), digest_size=16).hexdigest()}|{tag}"
    if isinstance(ref, (str, Path)) and not str(ref).startswith(("data:", "http://", "https://")):
        path = local_path(str(ref))
        try:
            stat = path.stat()
        except OSError:
            return None
        return f"file:{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{tag}"
    return None


class _Cache:
    """Fingerprints of images that decoded fine (a set on disk); any failure to use it just means no cache."""

    def __init__(self, folder: Path | None):
        self.db = None
        if folder is None:
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(cache_file(folder), timeout=30, check_same_thread=False)
            self.db.execute("CREATE TABLE IF NOT EXISTS ok (key TEXT PRIMARY KEY)")
        except (OSError, sqlite3.Error):
            self.db = None

    def known(self, keys: list[str]) -> set[str]:
        if self.db is None or not keys:
            return set()
        found: set[str] = set()
        try:
            for start in range(0, len(keys), 500):
                chunk = keys[start:start + 500]
                rows = self.db.execute(f"SELECT key FROM ok WHERE key IN ({','.join('?' * len(chunk))})", chunk)
                found.update(r[0] for r in rows)
        except sqlite3.Error:
            return set()
        return found

    def add(self, keys: list[str]) -> None:
        if self.db is None or not keys:
            return
        try:
            with self.db:
                self.db.executemany("INSERT OR IGNORE INTO ok VALUES (?)", [(k,) for k in keys])
        except sqlite3.Error:
            pass

    def close(self) -> None:
        if self.db is not None:
            self.db.close()


def _check_image(ref: Any, limits: MediaLimits) -> str | None:
    try:
        load_image(ref, limits).close()
    except MediaError as exc:
        return str(exc)
    except Exception as exc:  # a decoder bug on a hostile file is still this file's problem
        return f"cannot decode image: {type(exc).__name__}: {exc}"
    return None


def _check_video(ref: Any, limits: MediaLimits) -> str | None:
    if isinstance(ref, dict) and ref.get("video") is not None:
        ref = ref["video"]
    if isinstance(ref, (list, tuple)):
        if not ref:
            return "a video given as frames needs at least one frame"
        for f, frame in enumerate(ref):
            reason = _check_image(frame, limits)
            if reason:
                return f"frame {f}: {reason}"
        return None
    if isinstance(ref, (str, Path)) and not str(ref).startswith(("http://", "https://")):
        path = local_path(str(ref))
        if not path.is_file():
            return not_a_file_reason(path, "video")
        try:
            check_video_file(path, limits)  # opened and its first frame decoded; the frames are sampled when encoded
        except MediaError as exc:
            return str(exc)
    return None


def find_bad_prompts(samples: Sequence[Sample], system_prompt: str | None = None, prompt_suffix: str | None = None,
                     special_tokens_in_text: str = "refuse") -> list[MediaProblem]:
    """Samples whose chat cannot be built: placeholder count != media count, empty prompt, no user message; and with
    `special_tokens_in_text="refuse"`, chat special tokens of common templates in the text (the tokenizer, read
    later, may know more)."""
    from vlrft.data.sample import BadSampleError, build_messages, special_token_error, special_tokens_in

    problems = []
    for i, sample in enumerate(samples):
        try:
            build_messages(sample, system_prompt, prompt_suffix)
            found = special_tokens_in(sample) if special_tokens_in_text == "refuse" else []
            if found:
                raise special_token_error(sample, found)
        except BadSampleError as exc:
            problems.append(MediaProblem(i, sample.source, exc.field, exc.reason))
    return problems


def find_bad_media(samples: Sequence[Sample], limits: MediaLimits, workers: int | None = None,
                   use_cache: bool = True, progress: bool = False) -> list[MediaProblem]:
    """Every unusable image or video reference of `samples`, in sample order (see the module docstring)."""
    jobs: list[tuple[int, str, str, Any, str | None]] = []  # (sample index, field, kind, ref, fingerprint)
    for i, sample in enumerate(samples):
        for k, ref in enumerate(sample.images):
            jobs.append((i, f"images[{k}]", "image", ref, _fingerprint(ref, limits)))
        for k, ref in enumerate(sample.videos):
            key = _fingerprint(ref, limits) if isinstance(ref, (str, Path)) else None  # a file; frames: per image
            jobs.append((i, f"videos[{k}]", "video", ref, None if key is None else f"video|{key}"))
    cache = _Cache(cache_dir() if use_cache else None)
    try:
        known = cache.known(sorted({j[4] for j in jobs if j[4] is not None}))
        todo = [j for j in jobs if j[4] is None or j[4] not in known]

        def check(job):
            _, _, kind, ref, _ = job
            return (_check_image if kind == "image" else _check_video)(ref, limits)

        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # under torchrun each rank checks its share
        workers = workers or max(2, min(16, 2 * (os.cpu_count() or 1) // ranks_here))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = pool.map(check, todo)
            if progress and todo:
                from tqdm.auto import tqdm

                results = tqdm(results, total=len(todo), desc="checking media", unit="file", dynamic_ncols=True)
            reasons = list(results)
        cache.add(sorted({j[4] for j, r in zip(todo, reasons) if r is None and j[4] is not None}))
    finally:
        cache.close()
    return [MediaProblem(job[0], samples[job[0]].source, job[1], reason)
            for job, reason in zip(todo, reasons) if reason is not None]

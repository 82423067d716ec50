"""Math grading in worker processes that are killed when an answer takes too long.

Why processes: math-verify bounds its sympy work with `signal.alarm`, which works only in a main
thread (reward functions run in threads), and no signal interrupts a long C-level computation such as
the integer power in `9**9**9**9`. So answers go, one JSON line each, to `python -m
vlrft.rewards.math_worker` processes (plain subprocesses: no multiprocessing, so the user's main
module is never re-imported). A worker that has not answered within `timeout_s` is killed and
restarted, and that answer scores as wrong. Workers run under an address-space limit.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_STARTUP_TIMEOUT_S = 60.0  # importing sympy on a loaded machine can take a while


@dataclass(frozen=True)
class GraderSettings:
    processes: int = 0  # 0 = min(4, CPU cores per local rank)
    timeout_s: float = 5.0  # per answer, hard limit
    memory_mb: int = 2048  # address-space limit per worker; 0 = none
    step_timeout_s: int = 0  # math-verify's own alarm per parse/compare, whole seconds; 0 = timeout_s / 4
    batch_timeout_s: float | None = None  # a batch's answers not started within it are not graded (None: all are)

    @property
    def worker_count(self) -> int:
        if self.processes > 0:
            return self.processes
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun; every rank has its own grader
        return max(1, min(4, (os.cpu_count() or 1) // max(1, ranks_here)))

    @property
    def op_timeout(self) -> int:
        """Whole seconds for each math-verify parse/compare (its alarm takes integers)."""
        return self.step_timeout_s if self.step_timeout_s > 0 else max(1, int(self.timeout_s / 4))


class GraderWorker:
    """One worker subprocess, used by one thread at a time; (re)started on demand."""

    def __init__(self, settings: GraderSettings):
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.kills = 0

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # so the child imports this same vlrft
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "vlrft.rewards.math_worker", "--memory-mb", str(self.settings.memory_mb),
               "--op-timeout", str(self.settings.op_timeout)]
        # stderr goes to a file (a pipe nobody reads could fill up and block the worker); it explains failed starts.
        with tempfile.TemporaryFile() as stderr:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env)
            if self._read_line(time.monotonic() + _STARTUP_TIMEOUT_S) == b"ready":
                return
            self.stop()
            stderr.seek(0)
            detail = " ".join(stderr.read().decode(errors="replace").split()[-40:])
        raise RuntimeError(f"math grader worker did not start ({' '.join(cmd)}): {detail or 'no output'}")

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the worker, or None on timeout or if it died."""
        fd, buffer = self.proc.stdout.fileno(), b""
        while b"\n" not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buffer += chunk
        return buffer.split(b"\n", 1)[0]

    def grade(self, answer: str, extracted: bool, reference: str) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps([answer, extracted, reference]).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.stop()
            return False
        reply = self._read_line(time.monotonic() + self.settings.timeout_s)
        if reply is None:  # overran (or died): kill it; the next answer starts a fresh one
            self.kills += 1
            self.stop()
            return False
        return reply == b"true"

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                stream.close()
            self.proc = None


class MathGrader:
    """Grades (answer, answer_is_extracted, reference) triples in parallel worker processes."""

    def __init__(self, settings: GraderSettings | None = None):
        self.settings = settings or GraderSettings()
        self._workers = [GraderWorker(self.settings) for _ in range(self.settings.worker_count)]
        self._idle: queue.Queue[GraderWorker] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)
        self._threads = ThreadPoolExecutor(self.settings.worker_count, thread_name_prefix="vlrft-grader")

    @property
    def kills(self) -> int:
        """Answers whose worker was killed for overrunning `timeout_s` (for diagnostics and tests)."""
        return sum(w.kills for w in self._workers)

    def _grade_one(self, triple: tuple[str, bool, str], deadline: float | None) -> bool | None:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:  # the batch's time is up: not graded
            return None
        try:
            worker = self._idle.get(timeout=wait)
        except queue.Empty:  # no worker came free before the batch's time was up
            return None
        try:
            return worker.grade(*triple)
        finally:
            self._idle.put(worker)

    def grade(self, triples: list[tuple[str, bool, str]]) -> list[bool | None]:
        """Equivalent or not, in order; an answer that overruns or crashes its worker counts as not equivalent.

        With `batch_timeout_s` an answer that no worker took up within it is not graded (None): without it, a
        batch of slow answers (each up to `timeout_s`, a few workers) outlasts the reward's own timeout, and
        its queued answers then delay the next batch.
        """
        if not triples:
            return []
        limit = self.settings.batch_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        return list(self._threads.map(lambda triple: self._grade_one(triple, deadline), triples))

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for worker in self._workers:
            worker.stop()


_grader: MathGrader | None = None
_grader_lock = threading.Lock()


def configure_grader(processes: int = 0, timeout_s: float = 5.0, memory_mb: int = 2048,
                     batch_timeout_s: float | None = None) -> None:
    """Set the shared grader's settings (replacing it if they changed)."""
    global _grader
    settings = GraderSettings(processes, timeout_s, memory_mb, batch_timeout_s=batch_timeout_s)
    with _grader_lock:
        if _grader is not None and _grader.settings == settings:
            return
        old, _grader = _grader, MathGrader(settings)
    if old is not None:
        old.close()


def get_grader() -> MathGrader:
    """The process-wide grader; its workers start on the first answer that needs math."""
    global _grader
    with _grader_lock:
        if _grader is None:
            _grader = MathGrader()
        return _grader


@atexit.register
def _close_grader() -> None:
    if _grader is not None:
        _grader.close()

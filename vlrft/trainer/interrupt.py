"""Ctrl-C or SIGTERM that loses nothing: finish the checkpoint being written, and optionally save at the end of the step.

`InterruptGuard` replaces the SIGINT and SIGTERM handlers while training (main thread only).
SIGTERM is what a scheduler sends before it preempts a job (SLURM, Kubernetes), and what torchrun
forwards to every worker when it is itself terminated; it is treated like Ctrl-C:

* with `save_on_interrupt` the first signal only sets `requested`; the trainer finishes the current
  step, saves a checkpoint and stops (`TrainingInterrupted`, carrying the signal). A second one stops
  at once.
* without it, the signal raises `KeyboardInterrupt` at once (SIGTERM too, so `finally` blocks and
  open files close rather than the process vanishing).
* either way, a signal that arrives inside `saving()` is held until the checkpoint is complete, so
  an almost-written checkpoint is never abandoned.

A scheduler kills after a grace period (torchrun: 30 s after forwarding SIGTERM), so the step and
the save must fit in it; what does not is covered by the periodic checkpoints (`train.save_every`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C or SIGTERM after saving; the message says where and how to continue."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = signum  # the command exits with 128 + signum, as a process killed by it would


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InterruptGuard:
    def __init__(self, save_on_interrupt: bool = True):
        self.save_on_interrupt = save_on_interrupt
        self.requested = False  # a signal asked to stop at the end of the step
        self.signum = signal.SIGINT  # the first signal that asked
        self._in_save = False
        self._held = 0  # a signal that arrived during a save and must be raised after it (0: none)
        self._previous: dict[int, object] = {}

    def install(self) -> "InterruptGuard":
        """Take over SIGINT and SIGTERM (only possible, and only needed, in the main thread)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        return self

    def uninstall(self) -> None:
        """Give the signals back to whoever had them."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def __enter__(self) -> "InterruptGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        name = _signal_name(signum)
        if self._in_save:
            if self.save_on_interrupt and not self.requested:
                self.requested, self.signum = True, signum
            else:
                self._held = signum
            print(f"\n{name}: finishing the checkpoint being written first", file=sys.stderr, flush=True)
            return
        if self.save_on_interrupt and not self.requested:
            self.requested, self.signum = True, signum
            print(f"\n{name}: stopping after this step and saving a checkpoint ({name} again to stop at once)",
                  file=sys.stderr, flush=True)
            return
        raise _interrupt(signum)

    @contextlib.contextmanager
    def saving(self):
        """A checkpoint write that Ctrl-C does not cut short."""
        self._in_save = True
        try:
            yield
        finally:
            self._in_save = False
        if self._held:
            signum, self._held = self._held, 0
            raise _interrupt(signum)


def _interrupt(signum: int) -> KeyboardInterrupt:
    """The KeyboardInterrupt a signal raises at once, naming it (the command exits with 128 + signum)."""
    error = KeyboardInterrupt(_signal_name(signum))
    error.signum = signum
    return error


def _signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name

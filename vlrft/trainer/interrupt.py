"""Ctrl-C that loses nothing: finish the checkpoint being written, and optionally save at the end of the step.

`InterruptGuard` replaces the SIGINT handler while training (main thread only):

* with `save_on_interrupt` the first Ctrl-C only sets `requested`; the trainer finishes the current
  step, saves a checkpoint and stops (`TrainingInterrupted`). A second Ctrl-C stops at once.
* without it, Ctrl-C raises `KeyboardInterrupt` at once, as Python does.
* either way, a Ctrl-C that arrives inside `saving()` is held until the checkpoint is complete, so
  an almost-written checkpoint is never abandoned.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C after saving; the message says where and how to continue."""


class InterruptGuard:
    def __init__(self, save_on_interrupt: bool = True):
        self.save_on_interrupt = save_on_interrupt
        self.requested = False  # a Ctrl-C asked to stop at the end of the step
        self._in_save = False
        self._held = False  # a Ctrl-C arrived during a save and must be raised after it
        self._previous = None

    def install(self) -> "InterruptGuard":
        """Take over SIGINT (only possible, and only needed, in the main thread)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def uninstall(self) -> None:
        """Give SIGINT back to whoever had it."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def __enter__(self) -> "InterruptGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        if self._in_save:
            if self.save_on_interrupt and not self.requested:
                self.requested = True
            else:
                self._held = True
            print("\nCtrl-C: finishing the checkpoint being written first", file=sys.stderr, flush=True)
            return
        if self.save_on_interrupt and not self.requested:
            self.requested = True
            print("\nCtrl-C: stopping after this step and saving a checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def saving(self):
        """A checkpoint write that Ctrl-C does not cut short."""
        self._in_save = True
        try:
            yield
        finally:
            self._in_save = False
        if self._held:
            self._held = False
            raise KeyboardInterrupt

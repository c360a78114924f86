"""Pre-emption: SIGTERM or Ctrl-C saves the step in hand, then the run stops."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import jax

from ultrajax.train.checkpoint import Checkpoints


class Preemption:
    """SIGTERM (a scheduler's pre-emption notice) or Ctrl-C: finish the step, save it, stop.

    A context manager around the step loop: it installs the handlers (which only
    set a flag, checked once per step: no host sync) and, on the way out, by any
    path, waits for the saves still being written, then puts the previous handlers
    back. A Ctrl-C while a stop is already under way exits at once (status 130):
    whoever presses it twice will not wait for the save, and a save cut short never
    replaces the last complete checkpoint. In a multi-process run both are left
    alone: JAX's pre-emption service makes every process agree on the step to stop
    at after a SIGTERM (`CheckpointManager.reached_preemption`), and a Ctrl-C seen
    by some processes only would have them save different steps.
    """

    NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}

    def __init__(self, ckpt: Checkpoints):
        self.ckpt = ckpt
        self.requested = False
        self.signum = signal.SIGTERM  # what stopped the run, once `requested`
        self._old = {}
        self._multi = jax.process_count() > 1

    @property
    def reason(self) -> str:
        return self.NAMES[self.signum]

    @property
    def code(self) -> int:
        """The exit status of a stopped run: 128 + the signal (143 SIGTERM, 130 Ctrl-C)."""
        return 128 + int(self.signum)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            _exit_now(self.ckpt.dir)
        if not self.requested:
            self.signum = signal.Signals(signum)
        self.requested = True

    def __enter__(self):
        if not self._multi and threading.current_thread() is threading.main_thread():
            for signum in self.NAMES:
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        try:
            self.ckpt.wait()  # the handlers stay: a second Ctrl-C here exits at once
        finally:
            for signum, old in self._old.items():
                signal.signal(signum, old)
            self._old = {}
        return False

    def __call__(self, step: int) -> bool:
        """Stop after `step`? (the state of `step` is then saved by the caller)"""
        if self._multi:
            self.requested = self.requested or self.ckpt.reached_preemption(step)
        return self.requested


def _exit_now(where: Path) -> None:
    """The second Ctrl-C: leave without waiting for the save thread (which an ordinary
    exit would join). os.write, not print: the main thread may be inside a print."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a flush interrupted in the middle: what is lost is lost
            pass
    message = (
        f"\nCtrl-C again: exiting without waiting for the save in progress; the last "
        f"complete checkpoint in {where} is kept\n"
    )
    os.write(2, message.encode())
    os._exit(130)

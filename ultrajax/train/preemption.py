"""Pre-emption: SIGTERM or Ctrl-C saves the step in hand, then the run stops; a Ctrl-C
before the first step ends the run at once, with nothing to save."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import jax

if TYPE_CHECKING:  # only named here: every command imports exit_now, and not Orbax with it
    from ultrajax.train.checkpoint import Checkpoints


STOPPED = (130, 143)  # the exit status of a run stopped by Ctrl-C or SIGTERM, saved


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


@contextmanager
def until_first_step() -> Iterator[None]:
    """Ctrl-C (or SIGTERM) while the run is being built and compiled: nothing is trained,
    so nothing is saved; the run ends at once with status 130 (143) and one line on stderr.

    Not Python's KeyboardInterrupt: XLA compiles on threads of its own, and the exception
    only stops the main thread's wait for them. The interpreter's exit then frees the
    backend under the compile still running: a segmentation fault (exit 139; 4 of 5
    tries on the tiny config). One that lands in a garbage-collection callback is dropped
    instead, and the run trains on as if no key was pressed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # SIGTERM too (it ended the process without a word), where the handler is Python's
    # to set: in a multi-process run JAX's pre-emption service holds it
    signums = [signal.SIGINT] + ([] if jax.distributed.is_initialized() else [signal.SIGTERM])
    old = {signum: signal.signal(signum, _nothing_trained) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


def _nothing_trained(signum, frame) -> NoReturn:
    if signum == signal.SIGINT:
        exit_now("interrupted before the first step: nothing was trained yet, nothing saved")
    message = "stopped by SIGTERM before the first step: nothing was trained yet, nothing saved"
    exit_now(message, code=128 + signum)


def _exit_now(where: Path) -> NoReturn:
    """The second Ctrl-C: leave without waiting for the save thread (which an ordinary
    exit would join)."""
    exit_now(
        f"Ctrl-C again: exiting without waiting for the save in progress; the last "
        f"complete checkpoint in {where} is kept"
    )


def exit_now(message: str, code: int = 130) -> NoReturn:
    """Leave at once with status `code` (130: Ctrl-C) and `message` on stderr, skipping the
    interpreter's teardown (threads still compiling or saving would crash under it, or be
    joined). Safe in a signal handler: os.write, not print (the main thread may be inside
    a print), and neither a closed pipe nor a flush cut in half stops the exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a flush interrupted in the middle: what is lost is lost
            pass
    try:
        os.write(2, f"\n{message}\n".encode())
    except OSError:  # stderr is a pipe whose reader is gone (Ctrl-C reaches `| tee` too)
        pass
    os._exit(code)

"""Batches made off the training thread: read, packed and put on the devices ahead of the
step that needs them, so the step never waits on the host (a bounded queue: `depth`
batches ahead, no more memory than that).

Each batch travels with the data state just after it, and `state()` is the state after
the last batch handed out: a checkpoint saves the position of what was trained on, not
of what was prefetched.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_DONE = object()


class Prefetcher:
    """`next()` returns `produce()`'s results in order, made by a thread `depth` ahead.

    `produce` and `snapshot` run on that thread only (once started); an exception there
    is raised by the `next()` that would have returned its batch. depth=0 makes every
    batch on the caller's thread (no thread at all)."""

    def __init__(self, produce: Callable[[], Any], snapshot: Callable[[], Any], depth: int):
        self._produce, self._snapshot, self.depth = produce, snapshot, depth
        self._state = snapshot()  # before the first batch
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                item = (self._produce(), self._snapshot())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer, raised there
            self._queue.put((_DONE, e))

    def __iter__(self):
        return self

    def __next__(self):
        if self.depth == 0:
            item = self._produce()
            self._state = self._snapshot()
            return item
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.depth)
            self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
            self._thread.start()
        item, state = self._queue.get()
        if item is _DONE:
            raise state
        self._state = state
        return item

    def state(self):
        """The data state after the last batch returned (before the first: the start)."""
        return self._state

    def close(self) -> None:
        """Stop the thread; batches made ahead are dropped (their state was never returned)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self._thread = None

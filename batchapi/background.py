"""Background: a daemon thread that runs one loop until it is told to stop.

The engine and encoder fronts, the shard runner's feeder and monitor, the result writer and the
sweep loop each run on one. The loop watches ``stopping`` and returns once it is set; ``stop``
sets it, rouses the loop (``wake``: the owner's own event or condition, which the loop waits
on) and joins the thread.

An exception that ends the loop is not caught here: it ends the thread, Python reports it
(``threading.excepthook``), and ``is_alive`` turns false, which is how the shard runner learns
that its engine died. Each loop catches what it can outlive itself.

Imports nothing of batchapi, so the engine may use it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    def __init__(self, name: str, loop: Callable[[], None], *, wake: Callable[[], None] | None = None,
                 stopping: threading.Event | None = None):
        """``wake``: called by ``stop`` once ``stopping`` is set, to end the loop's wait at once;
        ``stopping``: an event shared with the owner's other threads, which all stop with it."""
        self.name = name
        self.stopping = stopping if stopping is not None else threading.Event()
        self._loop = loop
        self._wake = wake
        self._thread: threading.Thread | None = None

    def start(self) -> Background:
        assert self._thread is None, f"the thread {self.name} is already started"
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Tell the loop to stop and wait up to ``timeout`` seconds (None: for good) for it to end."""
        self.stopping.set()
        if self._wake is not None:
            self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

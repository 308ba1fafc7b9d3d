"""The embedded worker: the shard runner and a sweep timer in threads of ``batchapi serve``.

No broker: the API's dispatcher calls straight into the runner (wake up for new shards,
abort a cancelled batch's requests now), and the timer runs the same sweep as ``batchapi beat``.
Should the engine thread die, the whole ``batchapi serve`` process shuts down (SIGTERM to itself),
as vLLM's API server does when its engine is dead, rather than take batches it can never run: its
supervisor restarts it, and the shards it gave back run then.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.exc import OperationalError

from batchapi.jobs.context import Jobs
from batchapi.jobs.errors import StorageError
from batchapi.workers.engine_setup import start_runner
from batchapi.workers.shard_runner import ShardRunner
from batchapi.workers.sweeper import sweep

log = logging.getLogger(__name__)


class EmbeddedWorker:
    """Pass it as the API's dispatcher and its ``run`` as the API's lifetime hook."""

    def __init__(self) -> None:
        self.runner: ShardRunner | None = None
        self._jobs: Jobs | None = None
        self._stop = threading.Event()
        self._sweep_now = threading.Event()
        self._timer: threading.Thread | None = None

    # Dispatcher

    def batch_ready(self, batch_id: str, shard_ids: list[str]) -> None:
        if self.runner is not None:
            self.runner.wake()

    def batch_cancelled(self, batch_id: str) -> None:
        if self.runner is not None:
            self.runner.abort_batch(batch_id, "batch_cancelled")
        self._sweep_now.set()

    # lifetime

    @contextmanager
    def run(self, jobs: Jobs) -> Iterator[EmbeddedWorker]:
        self._jobs = jobs
        self.runner = start_runner(jobs)
        self._timer = threading.Thread(target=self._sweep_loop, name="batchapi-sweep", daemon=True)
        self._timer.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._sweep_now.set()
            self._timer.join(timeout=30)
            self.runner.shutdown()
            self.runner = None

    def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sweep(self._jobs)
            except (OperationalError, StorageError, OSError):
                log.warning("sweep failed; the next one retries", exc_info=True)
            self._sweep_now.wait(self._jobs.settings.sweep_seconds)
            self._sweep_now.clear()

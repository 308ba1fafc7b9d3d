"""The embedded worker: the shard runner in threads of ``batchapi serve``.

No broker: the API's dispatcher calls straight into the runner (wake up for new shards,
abort a cancelled batch's requests now); the API's own sweep loop runs the sweeper's shard
steps, as ``batchapi beat`` does in production. Should the engine thread die, the whole
``batchapi serve`` process shuts down (SIGTERM to itself), as vLLM's API server does when its
engine is dead, rather than take batches it can never run: its supervisor restarts it, and the
shards it gave back run then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from batchapi import metrics
from batchapi.context import Context
from batchapi.openai.errors import ErrorCode
from batchapi.workers.engine_setup import start_runner
from batchapi.workers.shard_runner import ShardRunner

log = logging.getLogger(__name__)


class EmbeddedWorker:
    """Pass it as the API's dispatcher and its ``run`` as the API's lifetime hook."""

    def __init__(self) -> None:
        self.runner: ShardRunner | None = None

    # Dispatcher

    def batch_ready(self, batch_id: str, shard_ids: list[str], model: str | None = None) -> None:
        if self.runner is not None:
            self.runner.wake()

    def batch_cancelled(self, batch_id: str) -> None:
        if self.runner is not None:
            self.runner.abort_batch(batch_id, ErrorCode.BATCH_CANCELLED)

    # lifetime

    @contextmanager
    def run(self, ctx: Context) -> Iterator[EmbeddedWorker]:
        self.runner = start_runner(ctx)
        metrics.attach_runner(self.runner)  # the engine's gauges on the API's /metrics
        try:
            yield self
        finally:
            metrics.detach_runner(self.runner)
            self.runner.shutdown()
            self.runner = None

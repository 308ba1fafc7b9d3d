"""How the service hands validated work on: a small protocol the workers plug into.

The API calls ``batch_ready`` after a batch's shard rows are committed and ``batch_cancelled``
after a cancel is committed. The database stays the source of truth, so a dispatcher that
does nothing (the default) only delays work: shards wait ``queued`` until a worker or the
sweeper finds them.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)


class Dispatcher(Protocol):
    def batch_ready(self, batch_id: str, shard_ids: list[str], model: str | None = None) -> None:
        """The batch (of ``model``) is ``in_progress`` and these shards are ``queued``; wake whoever
        runs them (with Celery: the workers of that model)."""

    def batch_cancelled(self, batch_id: str) -> None:
        """The batch went to ``cancelling``; in-flight requests of it should be aborted."""


class NullDispatcher:
    def batch_ready(self, batch_id: str, shard_ids: list[str], model: str | None = None) -> None:
        log.debug("batch %s ready with %d queued shards", batch_id, len(shard_ids))

    def batch_cancelled(self, batch_id: str) -> None:
        log.debug("batch %s cancelling", batch_id)

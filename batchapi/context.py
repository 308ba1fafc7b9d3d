"""The service context: what every service function is handed (settings, the database, the
object store, the dispatcher and the API's callbacks), built once per process and passed down.

The dispatcher is how the service hands validated work on, a small protocol the workers plug
into: the API calls ``batch_ready`` after a batch's shard rows are committed and
``batch_cancelled`` after a cancel is committed. The database stays the source of truth, so a
dispatcher that does nothing (the default) only delays work: shards wait ``queued`` until a
worker or the sweeper finds them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from batchapi.config import Settings
from batchapi.db.session import make_engine, make_sessionmaker
from batchapi.storage import Storage, make_storage

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


@dataclass
class Context:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    storage: Storage
    dispatcher: Dispatcher = field(default_factory=NullDispatcher)
    # called with a new batch's id after it is committed (the API starts its validation)
    on_batch_created: Callable[[str], None] | None = None
    # called with a batch's id after its cancel is committed (the API's sweep runs at once)
    on_batch_cancelled: Callable[[str], None] | None = None

    def close(self) -> None:
        self.engine.dispose()


def open_context(settings: Settings, dispatcher: Dispatcher | None = None, storage: Storage | None = None) -> Context:
    engine = make_engine(settings)
    return Context(
        settings=settings,
        engine=engine,
        sessions=make_sessionmaker(engine),
        storage=storage or make_storage(settings),
        dispatcher=dispatcher or NullDispatcher(),
    )

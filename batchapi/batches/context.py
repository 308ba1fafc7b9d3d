"""What the service functions need, built once per process and passed down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from batchapi.batches.dispatch import Dispatcher, NullDispatcher
from batchapi.config import Settings
from batchapi.db.session import make_engine, make_sessionmaker
from batchapi.storage import Storage, make_storage


@dataclass
class Jobs:
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


def open_jobs(settings: Settings, dispatcher: Dispatcher | None = None, storage: Storage | None = None) -> Jobs:
    engine = make_engine(settings)
    return Jobs(
        settings=settings,
        engine=engine,
        sessions=make_sessionmaker(engine),
        storage=storage or make_storage(settings),
        dispatcher=dispatcher or NullDispatcher(),
    )

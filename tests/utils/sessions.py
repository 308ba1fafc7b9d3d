"""One transaction on the settings' database, for tests that call a db function the way a command does."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.orm import Session

from batchapi.config import Settings
from batchapi.db.session import make_engine, make_sessionmaker, session_scope

T = TypeVar("T")


def in_session(settings: Settings, act: Callable[[Session], T]) -> T:
    """``act(session)`` in a committed transaction on an engine of its own, disposed after."""
    engine = make_engine(settings)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            return act(session)
    finally:
        engine.dispose()

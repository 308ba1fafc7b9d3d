"""Database engine and session helpers; nothing connects until a function here is called."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from batchapi.config import Settings

PING_AFTER_IDLE_SECONDS = 1.0


def make_engine(settings: Settings) -> Engine:
    url = settings.sqlalchemy_url
    if url.startswith("sqlite"):
        return _sqlite_engine(url)
    return _postgres_engine(url, settings)


def _postgres_engine(url: str, settings: Settings) -> Engine:
    """A pooled engine that pings a connection on checkout only when it sat idle in the pool for
    PING_AFTER_IDLE_SECONDS: a busy pool reuses connections within milliseconds, and a ping on
    every checkout was one of the four round trips of a poll. A connection the server dropped
    while it was idle (a restart, an idle timeout) is still replaced before use; one that dies in
    use fails that use, and SQLAlchemy then invalidates the pool's older connections."""
    # LIFO: at a moderate rate the same few connections stay warm and unpinged
    engine = create_engine(url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow,
                           pool_use_lifo=True)

    @event.listens_for(engine.pool, "checkin")
    def _checked_in(_dbapi_conn, record):
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine.pool, "checkout")
    def _ping_if_idle(dbapi_conn, record, _proxy):
        idle_since = record.info.get("idle_since")
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise DisconnectionError(f"ping failed: {exc}") from exc  # the pool connects anew

    return engine


def _sqlite_engine(url: str) -> Engine:
    """The embedded default's file, written by two processes (``batchapi serve`` and its worker):
    WAL, so that readers never wait for the writer nor it for them, and a busy timeout on every
    connection (set first, so that even switching to WAL waits), so that a writer waits its turn
    for the file's one write lock instead of failing. pysqlite begins a transaction only at a
    session's first write, so no read snapshot is ever upgraded to a write (which WAL refuses at
    once, whatever the timeout)."""
    path = url.split(":///", 1)[-1]
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on any error."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise

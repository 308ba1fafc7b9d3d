"""Reads on the event loop, for the API's polled route: an async psycopg pool on PostgreSQL, a
plain sqlite3 connection on SQLite (the embedded default).

A poll through a sync session cost a thread hop and three round trips (BEGIN, the SELECT,
ROLLBACK) plus the ORM's load. Here it is one prepared SELECT on an autocommit connection,
awaited on the loop (on SQLite, run on the loop: a read of one row by its key in WAL mode takes
tens of microseconds and never waits for a writer, which a thread hop would cost more than), and
the row becomes a transient ``Batch`` (no session) so that the one renderer of a batch object
serves both paths. ``rendered`` keeps each batch's last rendering with the row it came from, so
a poll of a row that has not changed since the last one skips the renderer (a new column is part
of the row, so it is rendered too).
"""

from __future__ import annotations

import asyncio
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Callable

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from sqlalchemy import bindparam, inspect, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url

from batchapi.config import Settings
from batchapi.db.models import Batch


def _batch_query(dialect) -> tuple[str, tuple[str, ...]]:
    """The SELECT of one batch by id and project, in ``dialect``'s placeholders, and the attribute
    name of each column it returns, built from the model so that a new column is read too."""
    attrs = inspect(Batch).column_attrs
    stmt = select(*(attr.columns[0] for attr in attrs)).where(
        Batch.id == bindparam("id"), Batch.project_id == bindparam("project_id"), Batch.deleted_at.is_(None)
    )
    return str(stmt.compile(dialect=dialect)), tuple(attr.key for attr in attrs)


BATCH_SQL, BATCH_ATTRS = _batch_query(postgresql.psycopg.dialect())
RENDERS_KEPT = 4096  # batches whose last rendering is kept (the oldest goes first)


class _Reads(ABC):
    """What both readers give: a batch by id and project, or its rendering, kept with the row it
    was rendered from (the last ``RENDERS_KEPT`` batches'). A reader supplies ``_read`` (the row)
    and ``_batch`` (the row as a transient ``Batch``)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[tuple, bytes]] = {}

    @abstractmethod
    async def _read(self, project_id: str, batch_id: str) -> tuple | None:
        """The batch's row, or None."""

    @abstractmethod
    def _batch(self, row: tuple) -> Batch:
        """The row as a transient ``Batch``."""

    async def batch(self, project_id: str, batch_id: str) -> Batch | None:
        row = await self._read(project_id, batch_id)
        return None if row is None else self._batch(row)

    async def rendered(self, project_id: str, batch_id: str, render: Callable[[Batch], bytes]) -> bytes | None:
        """``render(batch)``, or its last result when the row is as it was then; None: no such batch."""
        row = await self._read(project_id, batch_id)
        if row is None:
            return None
        key = (project_id, batch_id)
        last = self._last.get(key)
        if last is not None and last[0] == row:
            return last[1]
        body = render(self._batch(row))
        self._last.pop(key, None)
        self._last[key] = (row, body)
        if len(self._last) > RENDERS_KEPT:
            del self._last[next(iter(self._last))]
        return body


def libpq_conninfo(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg://...`` as the plain URL libpq takes."""
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


class AsyncReads(_Reads):
    """A small pool of autocommit connections; ``open`` before use, ``close`` at shutdown. A read
    that finds its connection dropped runs again on another (checking each connection before use
    would be a second round trip per poll); a request waits up to
    ``timeout`` seconds for one, then fails with ``psycopg_pool.PoolTimeout``."""

    def __init__(self, conninfo: str, max_size: int, timeout: float = 10.0) -> None:
        # prepare_threshold=0: the statement is prepared on first use on each connection
        self.pool = AsyncConnectionPool(
            conninfo, min_size=1, max_size=max_size, open=False, timeout=timeout,
            kwargs={"autocommit": True, "prepare_threshold": 0},
        )
        super().__init__()

    async def open(self) -> None:
        await self.pool.open()

    async def close(self) -> None:
        await self.pool.close()

    def _batch(self, row: tuple) -> Batch:
        return Batch(**dict(zip(BATCH_ATTRS, row, strict=True)))

    async def _read(self, project_id: str, batch_id: str) -> tuple | None:
        try:
            return await self._batch_row(project_id, batch_id)
        except PoolTimeout:
            raise
        except psycopg.OperationalError:
            # the server dropped the connection while it sat in the pool (a restart, an idle
            # timeout): replace the pool's dead connections, and run the read (safe to repeat) again
            await self.pool.check()
            return await self._batch_row(project_id, batch_id)

    async def _batch_row(self, project_id: str, batch_id: str) -> tuple | None:
        async with self.pool.connection() as conn:
            cursor = await conn.execute(BATCH_SQL, {"id": batch_id, "project_id": project_id})
            return await cursor.fetchone()


class SqliteReads(_Reads):
    """The same reads on SQLite: one read-only sqlite3 connection in autocommit, used on the loop.
    Its values go through the column types' own conversions (JSON, Numeric, Boolean), as a
    session's would. A read that finds the file busy (rare in WAL mode: a reader waits only while
    the write-ahead log's index is rebuilt) is run again on a thread, where waiting blocks no one."""

    BUSY_WAIT_SECONDS = 30.0

    def __init__(self, path: str) -> None:
        self.path = path
        dialect = sqlite.pysqlite.dialect(paramstyle="named")
        self.sql, attrs = _batch_query(dialect)
        columns = [attr.columns[0] for attr in inspect(Batch).column_attrs]
        self.convert = [(attr, column.type.dialect_impl(dialect).result_processor(dialect, None))
                        for attr, column in zip(attrs, columns, strict=True)]
        self.conn: sqlite3.Connection | None = None
        super().__init__()

    async def open(self) -> None:
        """Nothing yet: the connection is made on the first read, once the file is surely migrated."""

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _batch(self, row: tuple) -> Batch:
        return Batch(**{attr: value if convert is None else convert(value)
                        for (attr, convert), value in zip(self.convert, row, strict=True)})

    async def _read(self, project_id: str, batch_id: str) -> tuple | None:
        params = {"id": batch_id, "project_id": project_id}
        try:
            if self.conn is None:
                # timeout 0: on the loop, a busy file is an error at once (then it waits on a thread)
                self.conn = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
                self.conn.execute("PRAGMA query_only=ON")
            return self.conn.execute(self.sql, params).fetchone()
        except sqlite3.OperationalError:
            return await asyncio.to_thread(self._read_waiting, params)

    def _read_waiting(self, params: dict) -> tuple | None:
        with sqlite3.connect(self.path, timeout=self.BUSY_WAIT_SECONDS, isolation_level=None) as conn:
            return conn.execute(self.sql, params).fetchone()


def open_reads(settings: Settings) -> AsyncReads | SqliteReads | None:
    """The polled route's reads; None for a database that is neither (an in-memory SQLite)."""
    url = settings.sqlalchemy_url
    if url.startswith("postgresql"):
        return AsyncReads(libpq_conninfo(url), settings.db_read_pool_size)
    path = url.split(":///", 1)[-1] if url.startswith("sqlite") else ""
    return SqliteReads(path) if path and path != ":memory:" else None

"""Reads on the event loop, for the API's polled route: an async psycopg pool on PostgreSQL.

A poll through a sync session cost a thread hop and three round trips (BEGIN, the SELECT,
ROLLBACK) plus the ORM's load. Here it is one prepared SELECT on an autocommit connection,
awaited on the loop, and the row becomes a transient ``Batch`` (no session) so that the one
renderer of a batch object serves both paths. SQLite (the embedded default) has no async driver
here and keeps the sync path; ``open_reads`` returns None for it.
"""

from __future__ import annotations

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from sqlalchemy import bindparam, inspect, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url

from batchapi.config import Settings
from batchapi.db.models import Batch


def _batch_query() -> tuple[str, tuple[str, ...]]:
    """The SELECT of one batch by id and project, in psycopg's placeholders, and the attribute
    name of each column it returns, built from the model so that a new column is read too."""
    attrs = inspect(Batch).column_attrs
    stmt = select(*(attr.columns[0] for attr in attrs)).where(
        Batch.id == bindparam("id"), Batch.project_id == bindparam("project_id"), Batch.deleted_at.is_(None)
    )
    sql = str(stmt.compile(dialect=postgresql.psycopg.dialect()))
    return sql, tuple(attr.key for attr in attrs)


BATCH_SQL, BATCH_ATTRS = _batch_query()


def libpq_conninfo(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg://...`` as the plain URL libpq takes."""
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


class AsyncReads:
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

    async def open(self) -> None:
        await self.pool.open()

    async def close(self) -> None:
        await self.pool.close()

    async def batch(self, project_id: str, batch_id: str) -> Batch | None:
        try:
            row = await self._batch_row(project_id, batch_id)
        except PoolTimeout:
            raise
        except psycopg.OperationalError:
            # the server dropped the connection while it sat in the pool (a restart, an idle
            # timeout): replace the pool's dead connections, and run the read (safe to repeat) again
            await self.pool.check()
            row = await self._batch_row(project_id, batch_id)
        return None if row is None else Batch(**dict(zip(BATCH_ATTRS, row, strict=True)))

    async def _batch_row(self, project_id: str, batch_id: str) -> tuple | None:
        async with self.pool.connection() as conn:
            cursor = await conn.execute(BATCH_SQL, {"id": batch_id, "project_id": project_id})
            return await cursor.fetchone()


def open_reads(settings: Settings) -> AsyncReads | None:
    url = settings.sqlalchemy_url
    if not url.startswith("postgresql"):
        return None
    return AsyncReads(libpq_conninfo(url), settings.db_read_pool_size)

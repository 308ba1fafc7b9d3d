"""Is the service able to work: the database answers and the storage is writable."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from batchapi.context import Context
from batchapi.errors import StorageError


@dataclass(frozen=True)
class HealthReport:
    database: str
    storage: str

    @property
    def ok(self) -> bool:
        return self.database == "ok" and self.storage == "ok"


def check_health(ctx: Context) -> HealthReport:
    try:
        with ctx.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        database = "ok"
    except SQLAlchemyError as exc:
        database = f"error: {type(exc).__name__}"
    try:
        ctx.storage.check()
        storage = "ok"
    except StorageError as exc:
        storage = f"error: {exc.message}"
    return HealthReport(database, storage)

"""The poll's async read (``db.reads``) returns the batch the ORM returns, field for field, and
keeps answering through dropped connections; a database it cannot reach is a 503."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import httpx
import psycopg
from fastapi import FastAPI

from batchapi.api import errors
from batchapi.api.schemas import BatchObject
from batchapi.db.models import Batch
from batchapi.db.reads import AsyncReads, libpq_conninfo, open_reads
from batchapi.db.session import session_scope
from tests.utils.job_rows import make_batch


def _fill(jobs, batch_id: str) -> Batch:
    """Every column of the batch set to something other than its default."""
    with session_scope(jobs.sessions) as session:
        batch = session.get(Batch, batch_id)
        batch.status, batch.model = "completed", "tiny-\u00e9"
        batch.errors = {"object": "list", "data": [{"code": "invalid_json", "line": 3, "message": "x \u2603"}]}
        batch.request_errors = {"object": "list", "total": 1,
                                "data": [{"code": "unknown_parameter", "line": 2, "message": "y", "param": "body.x"}]}
        batch.output_file_id, batch.error_file_id = "file-out", "file-err"
        batch.metadata_ = {"run": "nightly", "emoji": "\U0001f600"}
        batch.in_progress_at, batch.finalizing_at, batch.completed_at = 11, 12, 13
        batch.failed_at, batch.expired_at, batch.cancelling_at, batch.cancelled_at = 14, 15, 16, 17
        batch.request_completed, batch.request_failed = 2, 1
        batch.input_tokens, batch.cached_tokens, batch.output_tokens = 1234, 56, 789
        batch.estimated_input_tokens, batch.estimated_output_tokens = 1300, 900
        batch.price_input, batch.price_output = Decimal("0.15"), Decimal("0.6")
        batch.price_cached_input, batch.discount_percent = Decimal("0.075"), Decimal("37.5")
    with jobs.sessions() as session:
        return session.get(Batch, batch_id)


def test_the_async_read_renders_exactly_as_the_orm_row(pg_jobs):
    batch_id, _ = make_batch(pg_jobs, shards=3)
    stored = _fill(pg_jobs, batch_id)
    reads = open_reads(pg_jobs.settings)
    assert reads is not None

    async def read():
        await reads.open()
        try:
            return (await reads.batch(stored.project_id, batch_id),
                    await reads.batch("proj_other", batch_id),
                    await reads.batch(stored.project_id, "batch_missing"))
        finally:
            await reads.close()

    found, other_project, missing = asyncio.run(read())
    assert other_project is None and missing is None
    assert BatchObject.of(found).model_dump_json() == BatchObject.of(stored).model_dump_json()
    assert Decimal(BatchObject.of(found).cost.amount) > 0


def test_conninfo_keeps_credentials_and_options():
    url = "postgresql+psycopg://u:p%40ss@db.example:5433/jobs?sslmode=require"
    assert libpq_conninfo(url) == "postgresql://u:p%40ss@db.example:5433/jobs?sslmode=require"


def test_dropped_connections_are_replaced(pg_jobs, pg_url):
    batch_id, _ = make_batch(pg_jobs, shards=1)
    with pg_jobs.sessions() as session:
        project_id = session.get(Batch, batch_id).project_id
    reads = AsyncReads(libpq_conninfo(pg_jobs.settings.sqlalchemy_url), max_size=2)
    database = pg_url.rsplit("/", 1)[1]

    async def read_twice():
        await reads.open()
        try:
            first = await reads.batch(project_id, batch_id)
            with psycopg.connect(pg_url, autocommit=True) as admin:  # what a server restart does
                killed = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid() AND application_name = ''",
                    (database,)).fetchone()[0]
            return first, killed, await reads.batch(project_id, batch_id)
        finally:
            await reads.close()

    first, killed, second = asyncio.run(read_twice())
    assert killed >= 1
    assert first.id == second.id == batch_id


def test_an_unreachable_database_answers_503():
    reads = AsyncReads("postgresql://postgres@127.0.0.1:1/nothing?connect_timeout=1", max_size=1, timeout=1.0)
    app = FastAPI()
    errors.install(app)

    @app.get("/poll")
    async def poll():
        await reads.batch("proj", "batch")

    async def call():
        await reads.pool.open(wait=False)
        try:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                return await http.get("/poll")
        finally:
            await reads.close()

    response = asyncio.run(call())
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"] == {
        "message": "The service's database is unavailable; please retry.", "type": "server_error",
        "param": None, "code": "database_unavailable"}

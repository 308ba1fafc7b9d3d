"""The poll's reads on both databases: on SQLite (the embedded default) the plain read renders the
batch exactly as the ORM row does; on both, a batch is rendered again once its row changes (a
cached rendering is never served for a changed row) and not for an unchanged one."""

from __future__ import annotations

import asyncio

from batchapi.api.schemas import BatchObject
from batchapi.db.models import Batch
from batchapi.db.reads import SqliteReads, open_reads
from batchapi.db.session import session_scope
from tests.db.test_reads import _fill
from tests.utils.job_rows import make_batch


def _render(batch: Batch) -> bytes:
    return BatchObject.of(batch).model_dump_json().encode()


def test_the_sqlite_read_renders_exactly_as_the_orm_row(sqlite_jobs):
    batch_id, _ = make_batch(sqlite_jobs, shards=3)
    stored = _fill(sqlite_jobs, batch_id)
    reads = open_reads(sqlite_jobs.settings)
    assert isinstance(reads, SqliteReads)

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


def test_a_changed_row_is_rendered_again_and_an_unchanged_one_is_not(any_jobs):
    batch_id, _ = make_batch(any_jobs, shards=2)
    with any_jobs.sessions() as session:
        project_id = session.get(Batch, batch_id).project_id
    reads = open_reads(any_jobs.settings)
    renders: list[int] = []

    def render(batch: Batch) -> bytes:
        renders.append(batch.request_completed)
        return _render(batch)

    def progress(completed: int) -> None:
        with session_scope(any_jobs.sessions) as session:
            session.get(Batch, batch_id).request_completed = completed

    async def polls():
        await reads.open()
        try:
            bodies = [await reads.rendered(project_id, batch_id, render) for _ in range(3)]
            await asyncio.to_thread(progress, 1)
            bodies.append(await reads.rendered(project_id, batch_id, render))
            bodies.append(await reads.rendered(project_id, batch_id, render))
            bodies.append(await reads.rendered("proj_other", batch_id, render))
            return bodies
        finally:
            await reads.close()

    bodies = asyncio.run(polls())
    assert renders == [0, 1]
    assert bodies[0] == bodies[1] == bodies[2] and bodies[3] == bodies[4] != bodies[0]
    assert bodies[5] is None
    with any_jobs.sessions() as session:
        assert bodies[4] == _render(session.get(Batch, batch_id))

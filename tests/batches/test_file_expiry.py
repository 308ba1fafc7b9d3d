"""A file that expires while a batch is being created from it: the create and the sweeper's
file expiry are exclusive, whichever comes first, on PostgreSQL and on SQLite."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import event, text

from batchapi.batches import files, service
from batchapi.batches.files import upload_file
from batchapi.batches.states import BatchStatus
from batchapi.batches.sweeper import _each
from batchapi.db.clock import now
from batchapi.db.models import Batch, File
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope
from batchapi.errors import NotFound
from batchapi.models.registry import served_model_id
from tests.utils.batch_service import jsonl, request_line
from tests.utils.waiting import wait_until

CHAT = "/v1/chat/completions"


@pytest.fixture
def project(any_jobs, request) -> str:
    with session_scope(any_jobs.sessions) as session:
        return get_or_create_project(session, f"expiry-{request.node.name}-{id(any_jobs)}").id


def expiring_file(ctx, project: str, seconds: int) -> str:
    data = jsonl([request_line("a", served_model_id(ctx.settings), max_tokens=3)])
    f = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(data))
    with session_scope(ctx.sessions) as session:
        session.get(File, f.id).expires_at = now() + seconds
    return f.id


def clear_leftovers(ctx) -> None:
    """The expired files other tests left in the shared database, removed before a test's own sweep,
    so that this sweep has only the test's file to take or leave."""
    files.remove_expired(ctx, _each)


def expires_at(ctx, fid: str) -> int:
    with ctx.sessions() as session:
        return session.get(File, fid).expires_at


def waiting_on_a_lock(ctx) -> bool:
    """Some other connection of this database waits for a row lock (PostgreSQL)."""
    with ctx.engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )).scalar())


@contextmanager
def statements_of(ctx, thread: threading.Thread) -> Iterator[list[str]]:
    """The SQL ``thread`` sends on ``ctx``'s engine while inside, each noted as it goes out."""
    sent: list[str] = []

    def note(_conn, _cursor, statement, *_) -> None:
        if threading.get_ident() == thread.ident:
            sent.append(statement)

    event.listen(ctx.engine, "before_cursor_execute", note)
    try:
        yield sent
    finally:
        event.remove(ctx.engine, "before_cursor_execute", note)


def at_its_lock(ctx, sent: list[str], write: str) -> bool:
    """The other thread waits for the lock this one holds: on PostgreSQL as the server reports it;
    on SQLite, which reports no waits, once it has sent ``write`` (one writer at a time: that write
    waits for this one's transaction)."""
    if ctx.engine.dialect.name == "postgresql":
        return waiting_on_a_lock(ctx)
    return any(statement.startswith(write) for statement in sent)


def test_a_file_expiring_while_a_batch_is_created_from_it_stays_for_the_batch(any_jobs, project):
    """The create has checked the file and is about to commit when the file expires and the
    sweeper's expiry runs: the expiry waits for the create and then leaves the file to the batch."""
    ctx = any_jobs
    fid = expiring_file(ctx, project, 2)
    clear_leftovers(ctx)
    key = files.get_file(ctx, project, fid).storage_key
    swept: list[list[str]] = []
    sweeper = threading.Thread(target=lambda: swept.append(files.remove_expired(ctx, _each)))
    creating = threading.get_ident()

    def before_commit(session) -> None:
        pending = [*session.new, *session.identity_map.values()]
        if threading.get_ident() != creating or not any(isinstance(o, Batch) for o in pending):
            return
        wait_until(lambda: now() >= expiry, timeout=10)
        sweeper.start()  # the file has expired: the sweeper removes it now, if it can
        wait_until(lambda: swept or at_its_lock(ctx, sent, "DELETE FROM files"), timeout=30,
                   message="the sweeper to wait for this create")

    expiry = expires_at(ctx, fid)
    event.listen(ctx.sessions, "before_commit", before_commit)
    try:
        with statements_of(ctx, sweeper) as sent:
            batch = service.create_batch(ctx, project, fid, CHAT, "24h")
    finally:
        event.remove(ctx.sessions, "before_commit", before_commit)
    sweeper.join(30)
    assert swept == [[]], "the expiry removed a file a batch was being created from"
    assert batch.status == BatchStatus.VALIDATING
    with ctx.sessions() as session:
        assert session.get(File, fid) is not None
    assert b"".join(ctx.storage.iter_chunks(key))  # the batch can still read its input


def test_a_create_after_the_expiry_removed_the_file_fails_cleanly(any_jobs, project):
    """The expiry holds the file's row (it is deleting the object) when a create gets to it: the
    create fails with NotFound (the API's 404 error) and leaves no batch behind."""
    ctx = any_jobs
    fid = expiring_file(ctx, project, 1)
    clear_leftovers(ctx)
    expiry = expires_at(ctx, fid)
    wait_until(lambda: now() >= expiry, timeout=10)
    gate, inside = threading.Event(), threading.Event()
    real_delete = ctx.storage.delete

    def slow_delete(key: str) -> None:
        inside.set()
        assert gate.wait(30)
        real_delete(key)

    ctx.storage.delete = slow_delete  # the test's trick: hold the sweeper mid-removal
    swept: list[list[str]] = []
    sweeper = threading.Thread(target=lambda: swept.append(files.remove_expired(ctx, _each)))
    sweeper.start()
    try:
        assert inside.wait(30)
        failed: list[BaseException] = []

        def create() -> None:
            try:
                service.create_batch(ctx, project, fid, CHAT, "24h")
            except NotFound as exc:
                failed.append(exc)

        creator = threading.Thread(target=create)
        with statements_of(ctx, creator) as sent:
            creator.start()
            wait_until(lambda: not creator.is_alive() or at_its_lock(ctx, sent, "INSERT INTO batches"), timeout=30,
                       message="the create to wait for the sweeper")
        gate.set()
        creator.join(30)
        sweeper.join(30)
    finally:
        gate.set()
        ctx.storage.delete = real_delete
    assert swept == [[fid]] and len(failed) == 1 and failed[0].param == "id"
    with ctx.sessions() as session:
        assert session.query(Batch).filter(Batch.input_file_id == fid).count() == 0

"""A Message Batch's own limits (Anthropic's: 100,000 requests, a 256 MB create body), apart from
the limits on files uploaded to /v1/files, and a refused create that leaves no file behind."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from batchapi.batches import messages, service, states
from batchapi.batches.states import BatchStatus
from batchapi.db.models import Batch, File
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope
from batchapi.errors import InvalidRequest, NotFound
from batchapi.models.registry import served_model_id
from batchapi.storage.streams import TooLarge


@pytest.fixture
def project(sqlite_jobs, request) -> str:
    with session_scope(sqlite_jobs.sessions) as session:
        return get_or_create_project(session, f"messages-{request.node.name}").id


def body(n: int, model: str = "m", **params) -> dict:
    return {"requests": [{"custom_id": f"r{i}", "params": {"model": model, "max_tokens": 4, **params}}
                         for i in range(n)]}


def live_files(ctx, project: str) -> list[File]:
    with ctx.sessions() as session:
        return list(session.scalars(select(File).where(File.project_id == project, File.deleted_at.is_(None))))


def test_more_requests_than_the_file_line_limit_make_one_input_file(sqlite_jobs):
    n = sqlite_jobs.settings.max_file_lines + 1  # 50,001: within Anthropic's 100,000
    data, count = messages.input_lines(sqlite_jobs, body(n))
    assert count == n and data.count(b"\n") == n
    assert json.loads(data.splitlines()[-1]) == {"custom_id": f"r{n - 1}", "method": "POST", "url": "/v1/messages",
                                                 "body": {"model": "m", "max_tokens": 4}}


def test_one_request_past_the_limit_is_refused(sqlite_jobs, monkeypatch):
    monkeypatch.setattr(messages, "MAX_REQUESTS", 3)
    assert messages.input_lines(sqlite_jobs, body(3))[1] == 3
    with pytest.raises(InvalidRequest) as caught:
        messages.input_lines(sqlite_jobs, body(4))
    assert (caught.value.message, caught.value.param) == ("requests: at most 3 requests per batch, got 4", "requests")


def test_a_body_within_the_body_limit_becomes_a_file_within_the_file_limit(sqlite_jobs, monkeypatch):
    requests = body(3)
    monkeypatch.setattr(messages, "MAX_REQUESTS", 3)
    monkeypatch.setattr(messages, "MAX_BODY_BYTES", len(json.dumps(requests, separators=(",", ":"))))
    data, _ = messages.input_lines(sqlite_jobs, requests)
    assert len(data) <= messages.max_file_bytes()
    # numbers that grow when written again (1e9 is 1000000000.0) can pass it
    raw = '{"requests":[{"custom_id":"a","params":{"n":[1e9,1e9,1e9,1e9,1e9,1e9]}}]}'
    monkeypatch.setattr(messages, "MAX_REQUESTS", 1)
    monkeypatch.setattr(messages, "MAX_BODY_BYTES", len(raw))
    with pytest.raises(TooLarge) as caught:
        messages.input_lines(sqlite_jobs, json.loads(raw))
    assert caught.value.param == "requests" and caught.value.code == "file_too_large"


def test_the_input_file_may_be_larger_than_an_upload(sqlite_jobs, project):
    ctx = dataclasses.replace(sqlite_jobs, settings=sqlite_jobs.settings.model_copy(update={"max_upload_bytes": 64}))
    batch = messages.create(ctx, project, body(3, served_model_id(ctx.settings)))
    with ctx.sessions() as session:
        assert session.get(File, batch.input_file_id).bytes > 64


def test_a_refused_create_leaves_no_file(sqlite_jobs, project, monkeypatch):
    def database_away(*args, **kwargs):
        raise OperationalError("INSERT INTO batches", {}, Exception("the database went away"))

    monkeypatch.setattr(messages.service, "create_batch", database_away)  # after the file's commit
    with pytest.raises(OperationalError):
        messages.create(sqlite_jobs, project, body(2, "no-such-model"))
    assert live_files(sqlite_jobs, project) == []
    with sqlite_jobs.sessions() as session:
        (gone,) = session.scalars(select(File).where(File.project_id == project))
        assert session.scalar(select(Batch).where(Batch.project_id == project)) is None
    assert gone.filename == "message_batch_requests.jsonl"
    assert not sqlite_jobs.storage.exists(gone.storage_key)


def test_an_error_after_the_batch_is_in_keeps_its_input(sqlite_jobs, project, monkeypatch):
    def gone_away(batch_id):
        raise RuntimeError("the validation pool is shut down")

    monkeypatch.setattr(sqlite_jobs, "on_batch_created", gone_away)  # after create_batch's commit
    with pytest.raises(RuntimeError):
        messages.create(sqlite_jobs, project, body(2, served_model_id(sqlite_jobs.settings)))
    with sqlite_jobs.sessions() as session:
        batch = session.scalar(select(Batch).where(Batch.project_id == project))
    assert batch is not None and [f.id for f in live_files(sqlite_jobs, project)] == [batch.input_file_id]


def test_a_batch_whose_requests_all_ended_is_returned_by_a_cancel_as_it_is(sqlite_jobs, project, monkeypatch):
    ctx = sqlite_jobs
    gathering, ending = (messages.create(ctx, project, body(2, served_model_id(ctx.settings))).id for _ in range(2))
    with session_scope(ctx.sessions) as session:
        session.get(Batch, gathering).status = BatchStatus.FINALIZING  # its results being gathered
        session.get(Batch, ending).status = BatchStatus.IN_PROGRESS
    assert messages.cancel(ctx, project, messages.public_id(gathering)).status == BatchStatus.FINALIZING

    cancel_batch = service.cancel_batch

    def ends_first(ctx, project_id, bid):  # the batch ends between the cancel's look and its cancel
        with session_scope(ctx.sessions) as session:
            assert states.transition(session, bid, BatchStatus.FINALIZING)
            assert states.transition(session, bid, BatchStatus.COMPLETED)
        return cancel_batch(ctx, project_id, bid)

    monkeypatch.setattr(service, "cancel_batch", ends_first)
    assert messages.cancel(ctx, project, messages.public_id(ending)).status == BatchStatus.COMPLETED


def test_an_empty_cursor_lists_the_newest_page(sqlite_jobs, project):
    ids = [messages.create(sqlite_jobs, project, body(1, served_model_id(sqlite_jobs.settings))).id for _ in range(3)]
    for before_id, after_id in ((None, None), ("", None), (None, ""), ("", "")):
        rows, more = messages.list_page(sqlite_jobs, project, 2, after_id, before_id)
        assert ([r.id for r in rows], more) == (ids[::-1][:2], True), (before_id, after_id)


def test_a_batch_deleted_since_still_marks_a_listings_place(sqlite_jobs, project):
    ids = [messages.create(sqlite_jobs, project, body(1, served_model_id(sqlite_jobs.settings))).id for _ in range(3)]
    with session_scope(sqlite_jobs.sessions) as session:
        session.get(Batch, ids[1]).deleted_at = 1
    rows, more = messages.list_page(sqlite_jobs, project, 5, messages.public_id(ids[1]), None)
    assert ([r.id for r in rows], more) == ([ids[0]], False)
    rows, _ = messages.list_page(sqlite_jobs, project, 5, None, messages.public_id(ids[1]))
    assert [r.id for r in rows] == [ids[2]]
    with pytest.raises(NotFound):  # another project's is not a cursor
        messages.list_page(sqlite_jobs, "another-project", 5, messages.public_id(ids[1]), None)

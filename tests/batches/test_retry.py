"""Retry without an engine: which requests a retry takes from each kind of ended batch, and what
it refuses (the end-to-end runs: tests/workers/test_durability.py, tests/api/test_batches_cli.py)."""

from __future__ import annotations

import io
import json

import pytest
from sqlalchemy import update

from batchapi.batches import leases, service
from batchapi.batches.files import upload_file
from batchapi.batches.retry import retry_batch
from batchapi.batches.states import BatchStatus
from batchapi.db.models import Batch, File
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope
from batchapi.errors import Conflict, InvalidRequest, NotFound
from batchapi.model_store import served_model_id
from tests.utils.batch_service import jsonl, request_line

CHAT = "/v1/chat/completions"


@pytest.fixture
def project(any_jobs, request) -> str:
    with session_scope(any_jobs.sessions) as session:
        return get_or_create_project(session, f"retry-{request.node.name}-{id(any_jobs)}").id


def validating_batch(jobs, project: str, ids: list[str]) -> tuple[str, list[dict]]:
    lines = [request_line(cid, served_model_id(jobs.settings), max_tokens=3) for cid in ids]
    data = b"\xef\xbb\xbf" + jsonl(lines).replace(b"\n", b"\n\n", 1)  # a BOM and a blank line, as users send
    f = upload_file(jobs, project, "in.jsonl", "batch", io.BytesIO(data))
    return service.create_batch(jobs, project, f.id, CHAT, "6h", {"team": "evals"}).id, lines


def input_of(jobs, batch_id: str) -> list[dict]:
    with jobs.sessions() as session:
        key = session.get(File, session.get(Batch, batch_id).input_file_id).storage_key
    return [json.loads(line) for line in b"".join(jobs.storage.iter_chunks(key)).splitlines() if line.strip()]


def test_a_batch_cancelled_before_it_ran_retries_every_request(any_jobs, project):
    jobs = any_jobs
    original, lines = validating_batch(jobs, project, ["a", "b", "c"])
    with pytest.raises(Conflict) as refused:  # not ended yet
        retry_batch(jobs, project, original)
    assert refused.value.code == "invalid_state"
    service.cancel_batch(jobs, project, original)
    assert leases.settle_cancelled_validation(jobs, original) == BatchStatus.CANCELLED

    retry = retry_batch(jobs, project, original, "key-1")
    assert (retry.retry_of, retry.endpoint, retry.completion_window, retry.metadata_) == (
        original, CHAT, "6h", {"team": "evals"})
    assert retry.status == BatchStatus.VALIDATING and retry.model == served_model_id(jobs.settings)
    assert input_of(jobs, retry.id) == lines
    assert retry_batch(jobs, project, original, "key-1").id == retry.id  # the same key, the same batch
    assert retry_batch(jobs, project, original).id not in (retry.id, original)  # no key: a new one
    with pytest.raises(Conflict) as reused:
        retry_batch(jobs, project, retry.id, "key-1")
    assert reused.value.code == "invalid_state"  # the retry itself has not ended


def test_a_completed_batch_retries_only_its_error_file(any_jobs, project):
    jobs = any_jobs
    original, lines = validating_batch(jobs, project, ["a", "b", "c", "d"])
    errors = [{"custom_id": "d", "response": None, "error": {"code": "batch_expired"}},
              {"custom_id": "b", "response": {"status_code": 400}, "error": None}]
    error_file = upload_file(jobs, project, "errors.jsonl", "batch", io.BytesIO(jsonl(errors)))
    with session_scope(jobs.sessions) as session:
        session.execute(update(Batch).where(Batch.id == original).values(
            status=BatchStatus.EXPIRED, in_progress_at=1, error_file_id=error_file.id, output_expires_after=7200))
    retry = retry_batch(jobs, project, original)
    assert [line["custom_id"] for line in input_of(jobs, retry.id)] == ["b", "d"]  # in input order
    assert retry.output_expires_after == 7200


def test_nothing_to_retry(any_jobs, project):
    jobs = any_jobs
    done, _ = validating_batch(jobs, project, ["a"])
    failed, _ = validating_batch(jobs, project, ["a"])
    with session_scope(jobs.sessions) as session:
        session.execute(update(Batch).where(Batch.id == done).values(status=BatchStatus.COMPLETED, in_progress_at=1))
        session.execute(update(Batch).where(Batch.id == failed).values(
            status=BatchStatus.FAILED, errors={"object": "list", "data": [{"code": "empty_file"}]}))
    for batch_id in (done, failed):
        with pytest.raises(InvalidRequest) as refused:
            retry_batch(jobs, project, batch_id)
        assert refused.value.code == "nothing_to_retry"
    with pytest.raises(NotFound):
        retry_batch(jobs, project, "batch_missing")
    with pytest.raises(NotFound):  # another project's batch
        retry_batch(jobs, "proj_someone_else", done)


def test_an_original_whose_input_is_gone_cannot_be_retried(any_jobs, project):
    jobs = any_jobs
    original, _ = validating_batch(jobs, project, ["a"])
    with session_scope(jobs.sessions) as session:
        batch = session.get(Batch, original)
        batch.status = BatchStatus.CANCELLED
        session.get(File, batch.input_file_id).expires_at = 1  # expired, not swept yet
    with pytest.raises(NotFound) as gone:
        retry_batch(jobs, project, original)
    assert "expired" in str(gone.value) and gone.value.param == "batch_id"

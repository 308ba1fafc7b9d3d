"""Retry without an engine: which requests a retry takes from each kind of ended batch, and what
it refuses (the end-to-end runs: tests/workers/test_durability.py, tests/cli/test_batches.py)."""

from __future__ import annotations

import io
import json
import threading
from decimal import Decimal

import pytest
from sqlalchemy import select, update

from batchapi.batches import leases, request_results, service
from batchapi.batches.billing import cost
from batchapi.batches.files import upload_file
from batchapi.batches.finalize import finalize_batch
from batchapi.batches.leases import Outcome
from batchapi.batches.retry import retry_batch
from batchapi.batches.states import BatchStatus, ShardStatus
from batchapi.batches.sweeper import sweep
from batchapi.context import open_context
from batchapi.db.clock import now
from batchapi.db.models import Batch, File, Shard
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope
from batchapi.errors import Conflict, InvalidRequest, NotFound
from batchapi.models.registry import served_model_id
from batchapi.openai import render
from batchapi.openai.errors import RequestError
from batchapi.storage.keys import shard_error_key, shard_output_key
from tests.utils.batch_service import jsonl, request_line

CHAT = "/v1/chat/completions"


@pytest.fixture
def project(any_jobs, request) -> str:
    with session_scope(any_jobs.sessions) as session:
        return get_or_create_project(session, f"retry-{request.node.name}-{id(any_jobs)}").id


def validating_batch(ctx, project: str, ids: list[str], content: str = "Say hello.") -> tuple[str, list[dict]]:
    lines = [request_line(cid, served_model_id(ctx.settings), content, max_tokens=3) for cid in ids]
    data = b"\xef\xbb\xbf" + jsonl(lines).replace(b"\n", b"\n\n", 1)  # a BOM and a blank line, as users send
    f = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(data))
    return service.create_batch(ctx, project, f.id, CHAT, "6h", {"team": "evals"}).id, lines


def input_of(ctx, batch_id: str) -> list[dict]:
    with ctx.sessions() as session:
        key = session.get(File, session.get(Batch, batch_id).input_file_id).storage_key
    return [json.loads(line) for line in b"".join(ctx.storage.iter_chunks(key)).splitlines() if line.strip()]


def test_a_batch_cancelled_before_it_ran_retries_every_request(any_jobs, project):
    ctx = any_jobs
    original, lines = validating_batch(ctx, project, ["a", "b", "c"])
    with pytest.raises(Conflict) as refused:  # not ended yet
        retry_batch(ctx, project, original)
    assert refused.value.code == "invalid_state"
    service.cancel_batch(ctx, project, original)
    assert leases.settle_cancelled_validation(ctx, original) == BatchStatus.CANCELLED

    retry = retry_batch(ctx, project, original, "key-1")
    assert (retry.retry_of, retry.endpoint, retry.completion_window, retry.metadata_) == (
        original, CHAT, "6h", {"team": "evals"})
    assert retry.status == BatchStatus.VALIDATING and retry.model == served_model_id(ctx.settings)
    assert input_of(ctx, retry.id) == lines
    assert retry_batch(ctx, project, original, "key-1").id == retry.id  # the same key, the same batch
    assert retry_batch(ctx, project, original).id not in (retry.id, original)  # no key: a new one
    with pytest.raises(Conflict) as reused:
        retry_batch(ctx, project, retry.id, "key-1")
    assert reused.value.code == "invalid_state"  # the retry itself has not ended


def started_batch(ctx, project: str, ids: list[str], per_shard: int,
                  content: str = "Say hello.") -> tuple[str, list[dict], list]:
    """A batch past validation over ``ids``, ``per_shard`` requests a shard, each shard claimed by
    ``worker``: (batch id, its lines, its shards as ``leases.Claimed``)."""
    original, lines = validating_batch(ctx, project, ids, content)
    with ctx.sessions() as session:
        key = session.get(File, session.get(Batch, original).input_file_id).storage_key
    data = b"".join(ctx.storage.iter_chunks(key))
    ranges, offset = [], 0  # (line number, start, end) of each request line
    for number, line in enumerate(data.split(b"\n"), start=1):
        if line.strip():
            ranges.append((number, offset, offset + len(line) + 1))
        offset += len(line) + 1
    with session_scope(ctx.sessions) as session:
        session.execute(update(Batch).where(Batch.id == original).values(
            status=BatchStatus.IN_PROGRESS, in_progress_at=now(), validation_lease_expires_at=None))
        for index, at in enumerate(range(0, len(ranges), per_shard)):
            part = ranges[at:at + per_shard]
            session.add(Shard(id=f"{original}_{index:05d}", batch_id=original, index=index, first_line=part[0][0],
                              last_line=part[-1][0], start_byte=part[0][1], end_byte=part[-1][2],
                              request_count=len(part), prompt_token_counts=[1] * len(part),
                              status=ShardStatus.QUEUED, created_at=now()))
    shards = [leases.claim(ctx, f"{original}_{i:05d}", "worker") for i in range((len(ids) + per_shard - 1) // per_shard)]
    return original, lines, shards


def result(custom_id: str, ok: bool) -> bytes:
    if ok:
        return render.succeeded(custom_id, {"object": "chat.completion", "choices": []})
    return render.rejected(custom_id, RequestError("no", "body"))


def test_a_completed_batch_retries_only_its_unsucceeded_requests(any_jobs, project):
    ctx = any_jobs
    original, lines, (first, second) = started_batch(ctx, project, ["a", "b", "c", "d", "e"], per_shard=3)
    # a worker ran the first shard: a and c succeeded, b was refused; the second all succeeded
    assert leases.complete(ctx, first, "worker", Outcome(2, 1), *objects(ctx, first, [result("a", True),
                           result("c", True)], [result("b", False)]))
    assert leases.complete(ctx, second, "worker", Outcome(2, 0), *objects(ctx, second, [result("d", True),
                           result("e", True)], []))
    assert finalize_batch(ctx, original) == BatchStatus.COMPLETED
    with session_scope(ctx.sessions) as session:
        session.execute(update(Batch).where(Batch.id == original).values(output_expires_after=7200))
    retry = retry_batch(ctx, project, original)
    assert input_of(ctx, retry.id) == [lines[1]]
    assert retry.output_expires_after == 7200


def test_requests_the_sweeper_closed_unnamed_are_retried_by_their_line(any_jobs, project):
    """The sweeper closes an expired batch's shard whose input it cannot read as validation did
    (here its line limit was lowered since): its error lines name no custom_id. The retry still
    takes exactly the requests that did not succeed, each once."""
    ctx = any_jobs
    original, lines, (first, second) = started_batch(ctx, project, ["a", "b", "c", "d"], per_shard=2,
                                                     content="x" * 1100)
    assert leases.complete(ctx, first, "worker", Outcome(1, 1), *objects(ctx, first, [result("a", True)],
                                                                          [result("b", False)]))
    # c finished (durable) before the worker running the second shard died
    assert request_results.record(ctx, [request_results.Group(second.id, original, second.attempts, [
        request_results.Finished(0, True, result("c", True), 5, 0, 2)])], "worker") == {second.id}
    with session_scope(ctx.sessions) as session:
        session.execute(update(Shard).where(Shard.id == second.id).values(lease_expires_at=now() - 1))
        session.execute(update(Batch).where(Batch.id == original).values(expires_at=now()))
    strict = open_context(ctx.settings.model_copy(update={"max_line_bytes": 1024}), storage=ctx.storage)
    try:
        assert original in sweep(strict).finalized
    finally:
        strict.close()
    errors = [json.loads(line) for line in file_content(ctx, original, "error_file_id").splitlines()]
    assert [(e["custom_id"], (e["error"] or {}).get("code")) for e in errors] == [("b", None), (None, "batch_expired")]

    retry = retry_batch(ctx, project, original)
    assert input_of(ctx, retry.id) == [lines[1], lines[3]]  # b and d, in input order, once each


def objects(ctx, claimed, output: list[bytes], errors: list[bytes]) -> tuple[str, str]:
    out_key = shard_output_key(claimed.batch_id, claimed.index, claimed.attempts)
    err_key = shard_error_key(claimed.batch_id, claimed.index, claimed.attempts)
    ctx.storage.put_chunks(out_key, [b"".join(output)])
    ctx.storage.put_chunks(err_key, [b"".join(errors)])
    return out_key, err_key


def file_content(ctx, batch_id: str, column: str) -> bytes:
    with ctx.sessions() as session:
        key = session.get(File, getattr(session.get(Batch, batch_id), column)).storage_key
    return b"".join(ctx.storage.iter_chunks(key))


def test_nothing_to_retry(any_jobs, project):
    ctx = any_jobs
    done, _ = validating_batch(ctx, project, ["a"])
    failed, _ = validating_batch(ctx, project, ["a"])
    with session_scope(ctx.sessions) as session:
        session.execute(update(Batch).where(Batch.id == done).values(status=BatchStatus.COMPLETED, in_progress_at=1))
        session.execute(update(Batch).where(Batch.id == failed).values(
            status=BatchStatus.FAILED, errors={"object": "list", "data": [{"code": "empty_file"}]}))
    for batch_id in (done, failed):
        with pytest.raises(InvalidRequest) as refused:
            retry_batch(ctx, project, batch_id)
        assert refused.value.code == "nothing_to_retry"
    with pytest.raises(NotFound):
        retry_batch(ctx, project, "batch_missing")
    with pytest.raises(NotFound):  # another project's batch
        retry_batch(ctx, "proj_someone_else", done)


def test_an_original_whose_input_is_gone_cannot_be_retried(any_jobs, project):
    ctx = any_jobs
    original, _ = validating_batch(ctx, project, ["a"])
    with session_scope(ctx.sessions) as session:
        batch = session.get(Batch, original)
        batch.status = BatchStatus.CANCELLED
        session.get(File, batch.input_file_id).expires_at = 1  # expired, not swept yet
    with pytest.raises(NotFound) as gone:
        retry_batch(ctx, project, original)
    assert "expired" in str(gone.value) and gone.value.param == "batch_id"


def test_a_retry_keeps_the_originals_priority_and_cache_choice_and_the_rest_of_its_cap(any_jobs, project):
    ctx = any_jobs
    f = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(jsonl(
        [request_line(cid, served_model_id(ctx.settings), "Say hello.", max_tokens=3) for cid in "ab"])))
    originals = [service.create_batch(ctx, project, f.id, CHAT, "24h", result_cache=False, priority=7,
                                      max_cost=Decimal("2.00")).id for _ in range(2)]
    for original in originals:
        service.cancel_batch(ctx, project, original)
        assert leases.settle_cancelled_validation(ctx, original) == BatchStatus.CANCELLED
    with session_scope(ctx.sessions) as session:  # what they spent before they were stopped
        for original, output_tokens in zip(originals, (1_000_000, 100_000_000), strict=True):
            session.execute(update(Batch).where(Batch.id == original).values(output_tokens=output_tokens))
        spent = [cost(session.get(Batch, original)).amount for original in originals]
    assert Decimal(0) < spent[0] < Decimal(2) <= spent[1], spent

    retry = retry_batch(ctx, project, originals[0])
    assert (retry.priority, retry.result_cache, retry.max_cost) == (7, False, Decimal(2) - spent[0])
    with pytest.raises(Conflict) as again:  # the first retry was given all that was left
        retry_batch(ctx, project, originals[0])
    assert again.value.code == "max_cost_reached"
    with pytest.raises(Conflict) as refused:  # it spent its cap: a retry would spend more
        retry_batch(ctx, project, originals[1])
    assert refused.value.code == "max_cost_reached"


def test_two_retries_at_once_of_a_capped_batch_share_its_remainder(any_jobs, project):
    """Both start together and both pass the first look at the cap; the one that creates its batch
    second finds the remainder given and is refused, its uploaded input deleted."""
    ctx = any_jobs
    f = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(jsonl(
        [request_line(cid, served_model_id(ctx.settings), "Say hello.", max_tokens=3) for cid in "ab"])))
    original = service.create_batch(ctx, project, f.id, CHAT, "24h", max_cost=Decimal("2.00")).id
    service.cancel_batch(ctx, project, original)
    assert leases.settle_cancelled_validation(ctx, original) == BatchStatus.CANCELLED
    start = threading.Barrier(2)
    outcomes: list = []

    def retry() -> None:
        start.wait()
        try:
            outcomes.append(retry_batch(ctx, project, original))
        except Conflict as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=retry) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    created = [o for o in outcomes if isinstance(o, Batch)]
    refused = [o for o in outcomes if isinstance(o, Conflict)]
    assert len(created) == 1 and len(refused) == 1, outcomes
    assert created[0].max_cost == Decimal("2.00") and refused[0].code == "max_cost_reached"
    with ctx.sessions() as session:
        inputs = session.scalars(select(File.deleted_at).where(File.project_id == project,
                                                               File.filename == f"{original}_retry.jsonl")).all()
    assert len(inputs) == 2 and sum(deleted is None for deleted in inputs) == 1  # the refused retry's is deleted

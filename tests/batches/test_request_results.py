"""Per-request durability without an engine: result rows, their counts, and what becomes of them
when a worker completes the shard or the sweeper closes it (on PostgreSQL and SQLite)."""

from __future__ import annotations

import json
from decimal import Decimal

from sqlalchemy import func, select

from batchapi.batches import leases, request_results
from batchapi.batches.finalize import finalize_batch
from batchapi.batches.leases import Outcome
from batchapi.batches.request_results import Finished, Group
from batchapi.batches.service import iter_partial_results
from batchapi.batches.states import BatchStatus, ShardStatus
from batchapi.batches.sweeper import sweep
from batchapi.db.models import Batch, File, RequestResult, Shard
from batchapi.db.session import session_scope
from tests.utils.batch_service import jsonl, request_line
from tests.utils.job_rows import make_batch

IDS = ["r0", "r1", "r2", "r3"]


def running_batch(ctx) -> tuple[str, str, str]:
    """A started batch of one 4-request shard over a real input object; (batch, shard, project)."""
    batch_id, [shard_id] = make_batch(ctx, 1)
    data = jsonl([request_line(cid, "m") for cid in IDS])
    key = f"files/{batch_id}.jsonl"
    ctx.storage.put_chunks(key, [data])
    with session_scope(ctx.sessions) as session:
        batch = session.get(Batch, batch_id)
        batch.in_progress_at, batch.request_total = 1, len(IDS)
        session.get(File, batch.input_file_id).storage_key = key
        row = session.get(Shard, shard_id)
        row.end_byte, row.request_count, row.last_line = len(data), len(IDS), len(IDS)
        project_id = batch.project_id
    return batch_id, shard_id, project_id


def ok(seq: int, tokens: int = 3, thought: int = 0) -> Finished:
    return Finished(seq, True, json.dumps({"custom_id": IDS[seq], "response": {"status_code": 200}}).encode() + b"\n",
                    input_tokens=tokens, cached_tokens=1, output_tokens=tokens, reasoning_tokens=thought)


def refused(seq: int) -> Finished:
    return Finished(seq, False, json.dumps({"custom_id": IDS[seq], "response": {"status_code": 400}}).encode() + b"\n")


def batch_row(ctx, batch_id: str) -> Batch:
    with ctx.sessions() as session:
        return session.get(Batch, batch_id)


def rows_of(ctx, shard_id: str) -> int:
    with ctx.sessions() as session:
        return session.scalar(select(func.count()).select_from(RequestResult).where(RequestResult.shard_id == shard_id))


def lines_of(ctx, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    with ctx.sessions() as session:
        key = session.get(File, file_id).storage_key
    return [json.loads(line) for line in b"".join(ctx.storage.iter_chunks(key)).splitlines()]


def test_rows_are_counted_at_once_and_only_by_the_lease_owner(any_jobs):
    ctx = any_jobs
    batch_id, shard_id, project_id = running_batch(ctx)
    claimed = leases.claim(ctx, shard_id, "w1")
    assert request_results.record(ctx, [Group(shard_id, batch_id, 1, [ok(0, 5, 2), refused(2)])], "w1") == {shard_id}
    batch = batch_row(ctx, batch_id)
    assert (batch.request_completed, batch.request_failed, batch.input_tokens, batch.output_tokens) == (1, 1, 5, 5)
    assert batch.reasoning_tokens == 2
    # someone whose lease is gone writes nothing and counts nothing
    assert request_results.record(ctx, [Group(shard_id, batch_id, 1, [ok(1)])], "w2") == set()
    assert rows_of(ctx, shard_id) == 2 and batch_row(ctx, batch_id).request_completed == 1
    assert set(request_results.stored(ctx, shard_id)) == {0, 2}
    partial = b"".join(iter_partial_results(ctx, project_id, batch_id, "output")).splitlines()
    assert [json.loads(line)["custom_id"] for line in partial] == ["r0"]
    errors = b"".join(iter_partial_results(ctx, project_id, batch_id, "error")).splitlines()
    assert [json.loads(line)["custom_id"] for line in errors] == ["r2"]

    # the worker completes the shard: its render holds all four; only the rest is added
    outcome = Outcome(completed=3, failed=1, input_tokens=11, cached_tokens=3, output_tokens=11, reasoning_tokens=5)
    assert leases.complete(ctx, claimed, "w1", outcome, "out", "err")
    batch = batch_row(ctx, batch_id)
    assert (batch.request_completed, batch.request_failed, batch.input_tokens, batch.output_tokens) == (3, 1, 11, 11)
    assert batch.reasoning_tokens == 5
    assert rows_of(ctx, shard_id) == 0  # in the shard's objects now


def test_the_spend_cap_stops_a_batch_with_requests_left_and_not_one_whose_every_request_ended(any_jobs):
    ctx = any_jobs
    stopped, ended = running_batch(ctx), running_batch(ctx)  # four requests each
    for batch_id, shard_id, _ in (stopped, ended):
        with session_scope(ctx.sessions) as session:
            session.get(Batch, batch_id).max_cost = Decimal("0.000004")  # under two requests' cost
        leases.claim(ctx, shard_id, "w1")
    request_results.record(ctx, [Group(stopped[1], stopped[0], 1, [ok(0, 5), ok(1, 5)])], "w1")
    batch = batch_row(ctx, stopped[0])
    assert batch.status == BatchStatus.CANCELLING and batch.errors["data"][0]["code"] == "max_cost_reached"
    # the group that passes the cap ends the last of its requests: nothing is left to cut short
    request_results.record(ctx, [Group(ended[1], ended[0], 1, [ok(0, 5), ok(1, 5), ok(2, 5), refused(3)])], "w1")
    batch = batch_row(ctx, ended[0])
    assert (batch.status, batch.errors, batch.request_completed) == (BatchStatus.IN_PROGRESS, None, 3)


def test_the_sweeper_keeps_finished_requests_of_a_shard_it_closes(any_jobs):
    """A worker died holding the shard after two of its requests were durable; the batch is then
    cancelled: the sweeper's close keeps both, and only the other two end batch_cancelled."""
    ctx = any_jobs
    sweep(ctx)  # what other tests left in the shared database goes first: the sweep below has only this batch
    batch_id, shard_id, project_id = running_batch(ctx)
    leases.claim(ctx, shard_id, "dead-worker")
    request_results.record(ctx, [Group(shard_id, batch_id, 1, [ok(1, 4, 3), refused(3)])], "dead-worker")
    with session_scope(ctx.sessions) as session:  # its lease runs out; the user cancels
        session.get(Shard, shard_id).lease_expires_at = 1
        session.get(Batch, batch_id).status = BatchStatus.CANCELLING

    report = sweep(ctx)
    assert report.closed == [shard_id] and report.finalized == [batch_id]
    batch = batch_row(ctx, batch_id)
    assert batch.status == BatchStatus.CANCELLED
    assert (batch.request_completed, batch.request_failed, batch.request_unrun) == (1, 3, 2)
    assert (batch.input_tokens, batch.cached_tokens, batch.output_tokens, batch.reasoning_tokens) == (4, 1, 4, 3)
    output, errors = lines_of(ctx, batch.output_file_id), lines_of(ctx, batch.error_file_id)
    assert [line["custom_id"] for line in output] == ["r1"]
    assert [(e["custom_id"], (e.get("error") or {}).get("code")) for e in errors] == [
        ("r0", "batch_cancelled"), ("r2", "batch_cancelled"), ("r3", None)]
    with ctx.sessions() as session:
        closed = session.get(Shard, shard_id)
        assert (closed.status, closed.completed_count, closed.failed_count, closed.unrun_count) == (
            ShardStatus.FAILED, 1, 3, 2)
    partial = b"".join(iter_partial_results(ctx, project_id, batch_id, "error")).splitlines()
    assert [json.loads(line)["custom_id"] for line in partial] == ["r0", "r2", "r3"]
    assert finalize_batch(ctx, batch_id) is None  # ended once


def test_a_shard_taken_over_sees_the_rows_of_the_attempt_before(any_jobs):
    ctx = any_jobs
    batch_id, shard_id, _ = running_batch(ctx)
    leases.claim(ctx, shard_id, "w1")
    request_results.record(ctx, [Group(shard_id, batch_id, 1, [ok(0), ok(2)])], "w1")
    with session_scope(ctx.sessions) as session:
        session.get(Shard, shard_id).lease_expires_at = 1
    assert leases.requeue_expired(ctx, shard_id)
    again = leases.claim(ctx, shard_id, "w2")
    assert again.attempts == 2
    assert sorted(request_results.stored(ctx, shard_id)) == [0, 2]


def test_a_group_written_twice_counts_once_and_an_earlier_attempt_writes_nothing(any_jobs):
    ctx = any_jobs
    batch_id, shard_id, _ = running_batch(ctx)
    leases.claim(ctx, shard_id, "w1")
    group = Group(shard_id, batch_id, 1, [ok(0, 5), refused(2)])
    assert request_results.record(ctx, [group], "w1") == {shard_id}
    # the writer put the group back (its commit's answer was lost) and writes it again, with one more row
    again = Group(shard_id, batch_id, 1, [*group.rows, ok(1, 2)])
    assert request_results.record(ctx, [again], "w1") == {shard_id}
    batch = batch_row(ctx, batch_id)
    assert (batch.request_completed, batch.request_failed, batch.input_tokens) == (2, 1, 7)
    assert rows_of(ctx, shard_id) == 3
    # the same worker's lease ran out and it claimed the shard again: attempt 1's rows are fenced off
    with session_scope(ctx.sessions) as session:
        session.get(Shard, shard_id).lease_expires_at = 0
    assert leases.requeue_expired(ctx, shard_id)
    second = leases.claim(ctx, shard_id, "w1")
    assert second is not None and second.attempts == 2
    assert request_results.record(ctx, [Group(shard_id, batch_id, 1, [ok(3)])], "w1") == set()
    assert rows_of(ctx, shard_id) == 3
    assert request_results.record(ctx, [Group(shard_id, batch_id, 2, [ok(3)])], "w1") == {shard_id}
    assert rows_of(ctx, shard_id) == 4

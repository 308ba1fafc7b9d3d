"""The one sweeper: its validation step, its loop, and that one bad row never blocks the others
(the shard steps with real workers: tests/workers)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from sqlalchemy import update

from batchapi.batches import states
from batchapi.batches.states import BatchStatus, ShardStatus
from batchapi.batches.sweeper import SweepLoop, sweep
from batchapi.db.models import Batch, File, Shard
from batchapi.db.session import session_scope
from batchapi.storage.keys import shard_error_key, shard_output_key
from tests.utils.batch_service import jsonl, request_line
from tests.utils.job_rows import make_batch, shard


class RecordingValidator:
    def __init__(self):
        self.resumed: list[str] = []
        self.backfills = 0
        self.swept = threading.Event()

    def resume(self, batch_id):
        self.resumed.append(batch_id)

    def backfill(self):
        self.backfills += 1
        self.swept.set()


def stale(ctx, batch_id):
    with session_scope(ctx.sessions) as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(validation_lease_expires_at=1))


def test_stale_validations_go_to_the_validator_and_cancels_are_settled(sqlite_jobs):
    validating, _ = make_batch(sqlite_jobs, 0, status=BatchStatus.VALIDATING)
    fresh, _ = make_batch(sqlite_jobs, 0, status=BatchStatus.VALIDATING)
    cancelled, _ = make_batch(sqlite_jobs, 0, status=BatchStatus.VALIDATING)
    with session_scope(sqlite_jobs.sessions) as session:
        session.execute(update(Batch).where(Batch.id == fresh).values(validation_lease_expires_at=2**40))
        assert states.transition(session, cancelled, BatchStatus.CANCELLING)
    stale(sqlite_jobs, validating)
    stale(sqlite_jobs, cancelled)
    validator = RecordingValidator()
    report = sweep(sqlite_jobs, validator, shards=False)
    assert report.resumed == validator.resumed == [validating] and validator.backfills == 1
    with sqlite_jobs.sessions() as session:
        assert session.get(Batch, cancelled).status == BatchStatus.CANCELLED
        assert session.get(Batch, fresh).status == BatchStatus.VALIDATING


def test_without_a_validator_the_sweep_only_settles_cancels(sqlite_jobs):
    validating, _ = make_batch(sqlite_jobs, 0, status=BatchStatus.VALIDATING)
    stale(sqlite_jobs, validating)
    assert sweep(sqlite_jobs).resumed == []
    with sqlite_jobs.sessions() as session:
        assert session.get(Batch, validating).status == BatchStatus.VALIDATING


def test_the_loop_sweeps_at_start_and_when_poked(sqlite_jobs):
    validator = RecordingValidator()
    loop = SweepLoop(sqlite_jobs, interval=3600, validator=validator, shards=False).start()
    try:
        assert validator.swept.wait(30), "no sweep at start"
        validator.swept.clear()
        loop.poke()
        assert validator.swept.wait(30), "no sweep after a poke"
        assert validator.backfills == 2
    finally:
        loop.stop()


def cancelling_batch(ctx, custom_ids: list[str], request_count: int = 1) -> tuple[str, str]:
    """A started batch being cancelled: one queued shard over an input object of ``custom_ids``'
    lines, said to hold ``request_count`` requests."""
    batch_id, [shard_id] = make_batch(ctx, 1, status=BatchStatus.CANCELLING)
    data = jsonl([request_line(cid, "m") for cid in custom_ids])
    key = f"files/{batch_id}.jsonl"
    ctx.storage.put_chunks(key, [data])
    with session_scope(ctx.sessions) as session:
        batch = session.get(Batch, batch_id)
        batch.in_progress_at, batch.request_total = 1, request_count
        session.get(File, batch.input_file_id).storage_key = key
        row = session.get(Shard, shard_id)
        row.end_byte, row.request_count = len(data), request_count
    return batch_id, shard_id


def ended(ctx, batch_id: str) -> tuple[str, int, list[dict]]:
    """The batch's status, failed count and error-file lines."""
    with ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
        key = session.get(File, batch.error_file_id).storage_key if batch.error_file_id else None
        status, failed = batch.status, batch.request_failed
    lines = b"".join(ctx.storage.iter_chunks(key)).splitlines() if key else []
    return status, failed, [json.loads(line) for line in lines]


def test_a_shard_that_raises_does_not_stop_the_sweep_of_the_others(sqlite_jobs):
    ctx = sqlite_jobs
    stuck, stuck_shard = cancelling_batch(ctx, ["s1"])
    healthy, healthy_shard = cancelling_batch(ctx, ["h1"])
    # a directory where the stuck shard's error object goes: writing it fails on every try
    blocker = Path(ctx.settings.data_dir) / "storage" / shard_error_key(stuck, 0, 0, closing=True)
    (blocker / "inside").mkdir(parents=True)
    report = sweep(ctx)
    assert report.closed == [healthy_shard] and report.finalized == [healthy]
    status, failed, lines = ended(ctx, healthy)
    assert (status, failed) == (BatchStatus.CANCELLED, 1)
    assert [(line["custom_id"], line["error"]["code"]) for line in lines] == [("h1", "batch_cancelled")]
    assert ended(ctx, stuck)[:2] == (BatchStatus.CANCELLING, 0)
    assert shard(ctx, stuck_shard).status == ShardStatus.RUNNING  # the sweeper's claim, to be retried

    (blocker / "inside").rmdir()
    blocker.rmdir()
    with session_scope(ctx.sessions) as session:  # the sweeper's lease on it runs out
        session.execute(update(Shard).where(Shard.id == stuck_shard).values(lease_expires_at=1))
    assert sweep(ctx).finalized == [stuck]
    status, failed, lines = ended(ctx, stuck)
    assert (status, failed, [line["custom_id"] for line in lines]) == (BatchStatus.CANCELLED, 1, ["s1"])


def test_closing_a_shard_deletes_the_objects_its_earlier_writers_left(sqlite_jobs):
    ctx = sqlite_jobs
    batch_id, shard_id = cancelling_batch(ctx, ["c1"])
    with session_scope(ctx.sessions) as session:  # two attempts ran before; neither completed it
        session.execute(update(Shard).where(Shard.id == shard_id).values(attempts=2))
    left = [make(batch_id, 0, attempt, closing) for attempt, closing in ((1, False), (1, True), (2, False))
            for make in (shard_output_key, shard_error_key)]
    for key in left:
        ctx.storage.put_chunks(key, [b"an attempt's objects\n"])
    assert sweep(ctx).finalized == [batch_id]
    assert [key for key in left if ctx.storage.exists(key)] == []
    row = shard(ctx, shard_id)
    assert row.error_key == shard_error_key(batch_id, 0, 2, closing=True)
    assert [line["custom_id"] for line in ended(ctx, batch_id)[2]] == ["c1"]


def test_a_shard_whose_input_cannot_be_read_back_is_closed_unnamed(sqlite_jobs):
    ctx = sqlite_jobs
    # two lines where validation counted one: reading the shard back fails, and always would
    broken, _ = cancelling_batch(ctx, ["b1", "b2"], request_count=1)
    healthy, _ = cancelling_batch(ctx, ["h1"])
    assert sorted(sweep(ctx).finalized) == sorted([broken, healthy])
    status, failed, lines = ended(ctx, broken)
    assert (status, failed) == (BatchStatus.CANCELLED, 1)
    assert [(line["custom_id"], line["response"], line["error"]["code"]) for line in lines] == [
        (None, None, "batch_cancelled")]
    assert ended(ctx, healthy)[0] == BatchStatus.CANCELLED


def test_the_loop_removes_partial_writes_at_start_and_again_later(sqlite_jobs, monkeypatch):
    import os
    import time

    from batchapi.batches import sweeper
    from batchapi.storage.local import PARTIAL_GRACE_SECONDS
    from tests.utils.waiting import wait_until

    root = sqlite_jobs.storage.root / "files"
    root.mkdir(parents=True, exist_ok=True)

    def left_by_a_killed_writer(name):
        path = root / name
        path.write_bytes(b"x")
        old = time.time() - PARTIAL_GRACE_SECONDS - 60
        os.utime(path, (old, old))
        return path

    first = left_by_a_killed_writer(".tmp-first")
    monkeypatch.setattr(sweeper, "PARTIAL_WRITES_EVERY", 0.2)
    loop = SweepLoop(sqlite_jobs, interval=0.05, shards=False).start()
    try:
        wait_until(lambda: not first.exists(), timeout=30)
        later = left_by_a_killed_writer(".tmp-later")
        wait_until(lambda: not later.exists(), timeout=30)
    finally:
        loop.stop()

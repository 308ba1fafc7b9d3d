"""The one sweeper: its validation step and its loop (the shard steps: tests/workers)."""

from __future__ import annotations

import threading

from sqlalchemy import update

from batchapi.batches import states
from batchapi.batches.states import BatchStatus
from batchapi.batches.sweeper import SweepLoop, sweep
from batchapi.db.models import Batch
from batchapi.db.session import session_scope
from tests.utils.job_rows import make_batch


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


def stale(jobs, batch_id):
    with session_scope(jobs.sessions) as session:
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

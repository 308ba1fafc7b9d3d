"""State changes are single conditional UPDATEs: of two racers exactly one wins."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest

from batchapi.batches import states
from batchapi.batches.states import BatchStatus
from batchapi.db.clock import now
from batchapi.db.ids import batch_id
from batchapi.db.models import Batch
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope


def make_batch(ctx, status: str = BatchStatus.VALIDATING) -> str:
    bid = batch_id()
    with session_scope(ctx.sessions) as session:
        project = get_or_create_project(session, "states-test")
        session.add(Batch(
            id=bid, project_id=project.id, endpoint="/v1/chat/completions", input_file_id="file-x",
            completion_window="24h", status=status, created_at=now(), expires_at=now() + 86400,
            price_input=Decimal("0.1"), price_cached_input=Decimal("0.05"), price_output=Decimal("0.4"),
            discount_percent=Decimal(50),
        ))
    return bid


def status_of(ctx, bid: str) -> Batch:
    with ctx.sessions() as session:
        return session.get(Batch, bid)


def test_transition_stamps_time_and_refuses_illegal_sources(any_jobs):
    bid = make_batch(any_jobs)
    with session_scope(any_jobs.sessions) as session:
        assert not states.transition(session, bid, BatchStatus.COMPLETED)  # validating -> completed is illegal
        assert states.transition(session, bid, BatchStatus.IN_PROGRESS, request_total=3)
    batch = status_of(any_jobs, bid)
    assert (batch.status, batch.request_total) == (BatchStatus.IN_PROGRESS, 3)
    assert batch.in_progress_at is not None and batch.completed_at is None


def test_illegal_sources_are_an_assertion(any_jobs):
    with session_scope(any_jobs.sessions) as session, pytest.raises(AssertionError):
        states.transition(session, "batch_x", BatchStatus.COMPLETED, sources={BatchStatus.VALIDATING})


@pytest.mark.parametrize("rounds", [8])
def test_racing_cancel_and_start_only_one_wins(any_jobs, rounds):
    for _ in range(rounds):
        bid = make_batch(any_jobs)

        def attempt(target: str, bid: str = bid) -> bool:
            with session_scope(any_jobs.sessions) as session:
                return states.transition(session, bid, target, sources={BatchStatus.VALIDATING})

        with ThreadPoolExecutor(2) as pool:
            won = list(pool.map(attempt, [BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING]))
        assert won.count(True) == 1
        assert status_of(any_jobs, bid).status == (BatchStatus.IN_PROGRESS if won[0] else BatchStatus.CANCELLING)

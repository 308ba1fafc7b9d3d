"""The request_counts of a Message Batch, as Anthropic's: every request processing until the whole
batch has ended, then the outcomes (the SDK's ``MessageBatchRequestCounts``: succeeded, errored,
canceled and expired are zero until processing of the entire batch has ended)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from batchapi.api.message_schemas import MessageBatch, MessageBatchRequestCounts
from batchapi.batches.states import BatchStatus
from batchapi.db.models import Batch

T = 1_800_000_000


def batch(status: BatchStatus, completed: int = 0, failed: int = 0, unrun: int = 0) -> Batch:
    ended = {"completed_at": T + 50} if status == BatchStatus.COMPLETED else {}
    if status == BatchStatus.CANCELLED:
        ended = {"cancelled_at": T + 50}
    return Batch(id="batch_x", project_id="p", endpoint="/v1/messages", input_file_id="file_x",
                 completion_window="24h", status=status, created_at=T, expires_at=T + 86400,
                 request_total=10, request_completed=completed, request_failed=failed, request_unrun=unrun,
                 currency="usd", price_input=Decimal(0), price_cached_input=Decimal(0), price_output=Decimal(0),
                 discount_percent=Decimal(50), **ended)


@pytest.mark.parametrize("status", [BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                                    BatchStatus.CANCELLING])
def test_every_request_is_processing_until_the_batch_has_ended(status):
    counts = MessageBatchRequestCounts.of(batch(status, completed=6, failed=3, unrun=1))
    assert counts.model_dump() == {"processing": 10, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}


def test_an_ended_batch_has_its_outcomes_and_nothing_processing():
    counts = MessageBatchRequestCounts.of(batch(BatchStatus.COMPLETED, completed=8, failed=2))
    assert counts.model_dump() == {"processing": 0, "succeeded": 8, "errored": 2, "canceled": 0, "expired": 0}
    # 3 succeeded, 1 ran and failed, 2 cut off by the cancel, 4 in shards never made
    counts = MessageBatchRequestCounts.of(batch(BatchStatus.CANCELLED, completed=3, failed=3, unrun=2))
    assert counts.model_dump() == {"processing": 0, "succeeded": 3, "errored": 1, "canceled": 6, "expired": 0}


def test_processing_reaches_zero_only_when_the_results_are_there():
    running = MessageBatch.of(batch(BatchStatus.IN_PROGRESS, completed=9, failed=1), "http://h/")
    assert running.request_counts.processing == 10 and running.results_url is None
    done = MessageBatch.of(batch(BatchStatus.COMPLETED, completed=9, failed=1), "http://h/")
    assert done.request_counts.processing == 0
    assert done.results_url == "http://h/v1/messages/batches/msgbatch_x/results"

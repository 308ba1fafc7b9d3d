"""Response bodies of Anthropic's Message Batches API, from the one batch row."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel

from batchapi.api.schemas import ERRORS
from batchapi.batches.messages import public_id
from batchapi.batches.states import TERMINAL, BatchStatus
from batchapi.db.models import Batch

PROCESSING = {BatchStatus.CANCELLING: "canceling", BatchStatus.COMPLETED: "ended", BatchStatus.FAILED: "ended",
              BatchStatus.EXPIRED: "ended", BatchStatus.CANCELLED: "ended"}  # the rest are in_progress
# where the requests that did not finish went, by how the batch ended
UNFINISHED = {BatchStatus.CANCELLED: "canceled", BatchStatus.EXPIRED: "expired"}


def rfc3339(t: int | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


class MessageBatchRequestCounts(BaseModel):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int

    @classmethod
    def of(cls, b: Batch) -> MessageBatchRequestCounts:
        """As Anthropic's: every request ``processing`` until the whole batch has ended (a client
        that polls until ``processing`` is 0 then finds the results), then the batch's counts: a
        failed request is ``errored`` unless a cancel or expiry cut it off before it ran
        (``request_unrun``), and every request of a cancelled or expired batch that is neither
        succeeded nor errored is canceled or expired (those of shards never made, too); a batch
        that failed validation ran none, so all errored."""
        status = BatchStatus(b.status)
        if status not in TERMINAL:
            return cls(processing=b.request_total, succeeded=0, errored=0, canceled=0, expired=0)
        counts = dict(succeeded=b.request_completed, errored=b.request_failed, canceled=0, expired=0)
        if status == BatchStatus.FAILED:
            counts["errored"] = b.request_total - b.request_completed
        elif status in UNFINISHED:
            counts["errored"] = b.request_failed - b.request_unrun
            counts[UNFINISHED[status]] = b.request_total - b.request_completed - counts["errored"]
        return cls(processing=0, **counts)


class MessageBatch(BaseModel):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    ended_at: str | None
    created_at: str
    expires_at: str
    cancel_initiated_at: str | None
    archived_at: str | None = None
    results_url: str | None

    @classmethod
    def of(cls, b: Batch, base_url: str) -> MessageBatch:
        status = PROCESSING.get(BatchStatus(b.status), "in_progress")
        ended = b.completed_at or b.failed_at or b.expired_at or b.cancelled_at
        mid = public_id(b.id)
        return cls(
            id=mid, processing_status=status, request_counts=MessageBatchRequestCounts.of(b),
            ended_at=rfc3339(ended) if status == "ended" else None, created_at=rfc3339(b.created_at),
            expires_at=rfc3339(b.expires_at), cancel_initiated_at=rfc3339(b.cancelling_at),
            results_url=f"{base_url.rstrip('/')}/v1/messages/batches/{mid}/results" if status == "ended" else None,
        )


class MessageBatchList(BaseModel):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(BaseModel):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The body of every error response on these routes, as Anthropic's (``api/errors.py``)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """As ``schemas.error_responses``, in Anthropic's error shape."""
    return {status: {"model": AnthropicErrorResponse, "description": ERRORS[status]} for status in statuses}

"""The statuses of batches and shards and their transitions: the one owner of both.

A batch's every change of status is one conditional UPDATE: ``transition`` only succeeds when
the batch is still in a status the target may be reached from, so two processes racing on one
batch cannot both win: the loser's UPDATE matches no row and it gets ``False``. The caller owns
the transaction (nothing here commits). Shards move ``queued -> running -> succeeded | failed``
through the conditional UPDATEs of ``leases``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from batchapi.batches.ended import batch_ended
from batchapi.db.clock import now
from batchapi.db.models import Batch


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class ShardStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"  # a worker holds its lease
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # closed early: cancelled, expired, or out of attempts (``last_error`` says which)


TERMINAL = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})
ACTIVE = frozenset(BatchStatus) - TERMINAL
OPEN_SHARDS = (ShardStatus.QUEUED, ShardStatus.RUNNING)
DONE_SHARDS = (ShardStatus.SUCCEEDED, ShardStatus.FAILED)

# target status -> the statuses it may be reached from
SOURCES: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.IN_PROGRESS: frozenset({BatchStatus.VALIDATING}),
    BatchStatus.FAILED: frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING}),
    BatchStatus.FINALIZING: frozenset({BatchStatus.IN_PROGRESS}),
    BatchStatus.COMPLETED: frozenset({BatchStatus.FINALIZING}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS}),
    BatchStatus.CANCELLED: frozenset({BatchStatus.CANCELLING}),
    BatchStatus.EXPIRED: frozenset({BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING}),
}

# the timestamp column each status stamps when it is entered
STAMP = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
    BatchStatus.EXPIRED: "expired_at",
}


def transition(
    session: Session,
    batch_id: str,
    target: BatchStatus,
    *,
    sources: frozenset[BatchStatus] | set[BatchStatus] | None = None,
    **values: Any,
) -> bool:
    """Move ``batch_id`` to ``target`` if it is in one of ``sources`` (default: all allowed).

    ``values`` are extra columns set in the same UPDATE (``errors``, ``output_file_id``, ...).
    Returns whether this call made the change.
    """
    allowed = SOURCES[target]
    if sources is not None:
        assert set(sources) <= allowed, f"{sorted(sources)} -> {target} is not a legal transition"
        allowed = frozenset(sources)
    values = {"status": target, STAMP[target]: now(), **values}
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(sorted(allowed)))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1 and target in TERMINAL:
        batch_ended(session, batch_id, target)  # its output files' expiry and webhook event commit with it
    return result.rowcount == 1

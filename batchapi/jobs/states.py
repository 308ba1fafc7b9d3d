"""The batch state machine of API.md; every change is one conditional UPDATE.

``transition`` only succeeds when the batch is still in a state the target may be reached
from, so two processes racing on one batch cannot both win: the loser's UPDATE matches no
row and it gets ``False``. The caller owns the transaction (nothing here commits).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from batchapi.jobs.ids import now
from batchapi.jobs.models import Batch

VALIDATING = "validating"
FAILED = "failed"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"

STATUSES = (VALIDATING, FAILED, IN_PROGRESS, FINALIZING, COMPLETED, EXPIRED, CANCELLING, CANCELLED)
TERMINAL = frozenset({FAILED, COMPLETED, EXPIRED, CANCELLED})
ACTIVE = frozenset(STATUSES) - TERMINAL

# target state -> the states it may be reached from
SOURCES: dict[str, frozenset[str]] = {
    IN_PROGRESS: frozenset({VALIDATING}),
    FAILED: frozenset({VALIDATING, IN_PROGRESS, FINALIZING}),
    FINALIZING: frozenset({IN_PROGRESS}),
    COMPLETED: frozenset({FINALIZING}),
    CANCELLING: frozenset({VALIDATING, IN_PROGRESS}),
    CANCELLED: frozenset({CANCELLING}),
    EXPIRED: frozenset({VALIDATING, IN_PROGRESS, FINALIZING}),
}

# the timestamp column each state stamps when it is entered
STAMP = {
    IN_PROGRESS: "in_progress_at",
    FAILED: "failed_at",
    FINALIZING: "finalizing_at",
    COMPLETED: "completed_at",
    CANCELLING: "cancelling_at",
    CANCELLED: "cancelled_at",
    EXPIRED: "expired_at",
}


def transition(
    session: Session,
    batch_id: str,
    target: str,
    *,
    sources: frozenset[str] | set[str] | None = None,
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
    return result.rowcount == 1

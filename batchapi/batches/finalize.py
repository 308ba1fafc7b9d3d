"""Finalize: when no shard of a batch is open, merge the shard objects into the batch's output
and error files (with the request results the sweeper's closed shards keep), sum the counts
and usage, and end the batch.

Idempotent: the merged objects have fixed keys (a second run rewrites the same bytes), and
the file rows, the sums and the final status are one transaction behind the batch's
conditional state change, so only one finalizer's rows survive.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from sqlalchemy import func, select

from batchapi.batches import request_results, states
from batchapi.batches.files import register_file
from batchapi.batches.states import OPEN_SHARDS, BatchStatus
from batchapi.context import Context
from batchapi.db.models import Batch, Shard
from batchapi.db.session import session_scope
from batchapi.openai.errors import ErrorCode
from batchapi.storage.keys import batch_error_key, batch_output_key

log = logging.getLogger(__name__)

SUMMED = ("completed_count", "failed_count", "unrun_count", "input_tokens", "cached_tokens", "output_tokens",
          "reasoning_tokens")  # shards
BATCH_COLUMNS = ("request_completed", "request_failed", "request_unrun", "input_tokens", "cached_tokens",
                 "output_tokens", "reasoning_tokens")
# the states a finalizer may end a batch from (``completed`` only after its own ``finalizing``)
FROM = {
    BatchStatus.COMPLETED: {BatchStatus.FINALIZING},
    BatchStatus.CANCELLED: {BatchStatus.CANCELLING},
    BatchStatus.EXPIRED: {BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING},
}


def finalize_batch(ctx: Context, batch_id: str, *, resume: bool = False) -> str | None:
    """End ``batch_id`` if all its shards are done; returns the status it ended in, or None when
    it is not ready (or another finalizer holds it). ``resume`` takes over a batch left in
    ``finalizing`` by a finalizer that died."""
    with ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status in states.TERMINAL or batch.status == BatchStatus.VALIDATING:
            return None
        status, project_id = batch.status, batch.project_id
        open_shards = session.scalar(
            select(func.count()).select_from(Shard).where(Shard.batch_id == batch_id, Shard.status.in_(OPEN_SHARDS))
        )
        if open_shards:
            return None
        reasons = set(session.scalars(select(Shard.last_error).where(Shard.batch_id == batch_id).distinct()))

    target = _target(status, reasons)
    if target is None:
        return None
    if target == BatchStatus.COMPLETED:
        if status == BatchStatus.IN_PROGRESS:
            with session_scope(ctx.sessions) as session:
                if not states.transition(session, batch_id, BatchStatus.FINALIZING, sources={BatchStatus.IN_PROGRESS}):
                    return None  # cancelled or finalized by someone else meanwhile
        elif not resume:
            return None
    return _merge_and_end(ctx, batch_id, project_id, target)


def _target(status: str, reasons: set[str | None]) -> str | None:
    if status == BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED
    if status not in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING):
        return None
    return BatchStatus.EXPIRED if ErrorCode.BATCH_EXPIRED in reasons else BatchStatus.COMPLETED


def _merge_and_end(ctx: Context, batch_id: str, project_id: str, target: str) -> str | None:
    with ctx.sessions() as session:
        shards = session.execute(
            select(Shard.id, Shard.output_key, Shard.error_key).where(Shard.batch_id == batch_id).order_by(Shard.index)
        ).all()
        with_rows = request_results.shards_with_rows(session, batch_id)
    out_size = ctx.storage.put_chunks(batch_output_key(batch_id), _concat(ctx, shards, with_rows, True))
    err_size = ctx.storage.put_chunks(batch_error_key(batch_id), _concat(ctx, shards, with_rows, False))
    with session_scope(ctx.sessions) as session:
        files = {}
        for name, key, size in (("output", batch_output_key(batch_id), out_size), ("errors", batch_error_key(batch_id), err_size)):
            if size:
                row = register_file(session, project_id, f"{batch_id}_{name}.jsonl", "batch_output", key, size)
                files[name] = row.id
        sums = session.execute(
            select(*(func.coalesce(func.sum(getattr(Shard, c)), 0) for c in SUMMED)).where(Shard.batch_id == batch_id)
        ).one()
        moved = states.transition(
            session, batch_id, target, sources=FROM[target],
            output_file_id=files.get("output"), error_file_id=files.get("errors"),
            **{column: int(value) for column, value in zip(BATCH_COLUMNS, sums, strict=True)},
        )
        if not moved:
            session.rollback()  # another finalizer won; its file rows stand, ours go
            return None
    log.info("batch %s %s: %d output bytes, %d error bytes", batch_id, target, out_size, err_size)
    return target


def _concat(ctx: Context, shards, with_rows: set[str], succeeded: bool) -> Iterator[bytes]:
    """The shards' output (``succeeded``) or error lines, in input order, their stored request
    results merged where the sweeper closed them."""
    for shard_id, output_key, error_key in shards:
        key = output_key if succeeded else error_key
        yield from request_results.shard_lines(ctx, shard_id, key, succeeded, shard_id in with_rows)

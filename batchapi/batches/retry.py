"""Retry (an extension, docs/API_EXTENSIONS.md): a new batch over exactly the requests of an ended
batch that did not succeed (failed, expired, cancelled: each line of its shards whose result is
not in the shard's output, ``_ShardOutcomes``), or, for a batch that ended before running any,
every request of its input.

The new batch's input file holds those lines as the original input held them, in input order;
its endpoint, completion window, metadata, ``output_expires_after``, ``priority`` and
``result_cache`` are the original's, and ``retry_of`` names it. An original with a ``max_cost``
passes on what it left as the retry's cap (its cap less its cost and less the caps of its earlier
retries, so the original and all its retries together stay within the cap); one with nothing left
is not retried (409 ``max_cost_reached``); two retries of it at once are given the remainder one
after the other (``_one_capped_retry_at_a_time``). An ``Idempotency-Key`` makes the call safe to repeat: the key is stored on the new batch, so the same
key gets the same batch back, across restarts too.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import func, select

from batchapi.batches import messages, request_results, service
from batchapi.batches.billing import cost, format_amount
from batchapi.batches.files import delete_file, get_file_row, upload_file
from batchapi.batches.states import DONE_SHARDS, TERMINAL, BatchStatus
from batchapi.context import Context
from batchapi.db.models import Batch, Shard
from batchapi.errors import Conflict, InvalidRequest, NotFound
from batchapi.openai.body import MESSAGES
from batchapi.openai.errors import ErrorCode
from batchapi.openai.lines import LongLine, is_blank, iter_lines, peek_line, strip_bom
from batchapi.openai.text import check_text

log = logging.getLogger(__name__)

SPOOL_BYTES = 16 * 1024 * 1024  # a retry's input is built in memory up to this, then on disk


def retry_batch(ctx: Context, project_id: str, bid: str, idempotency_key: str | None = None) -> Batch:
    check_text(idempotency_key, "Idempotency-Key")
    original = service.get_batch(ctx, project_id, bid)
    if original.status not in TERMINAL:
        raise Conflict(f"Cannot retry a batch with status '{original.status}': only a batch that has ended "
                       "(completed, failed, expired or cancelled) can be retried.", "batch_id", code="invalid_state")
    if idempotency_key is not None:
        existing = service.by_idempotency_key(ctx, project_id, idempotency_key, service.retry_fingerprint(bid))
        if existing is not None:
            return existing
    _unspent_or_refuse(ctx, original)  # before the upload: a refused retry stores nothing
    with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
        count = _write_input(ctx, original, spool)
        if not count:
            raise InvalidRequest(f"Batch {bid} has no failed, expired or cancelled requests to retry.", "batch_id",
                                 code="nothing_to_retry")
        spool.seek(0)
        # a Message Batch's input may be larger than an upload (messages.max_file_bytes)
        limit = messages.max_file_bytes() if original.endpoint == MESSAGES else None
        file = upload_file(ctx, project_id, f"{bid}_retry.jsonl", "batch", spool, max_bytes=limit)
    keep = original.output_expires_after  # its output files expire as the original's do
    try:
        with _one_capped_retry_at_a_time(ctx, original):
            budget = _unspent_or_refuse(ctx, original)  # again: another retry may have been given it meanwhile
            batch = service.create_batch(ctx, project_id, file.id, original.endpoint, original.completion_window,
                                         original.metadata_, idempotency_key, retry_of=bid,
                                         output_expires_after={"anchor": "created_at", "seconds": keep} if keep
                                         else None, result_cache=original.result_cache,
                                         priority=original.priority, max_cost=budget)
    except Exception:  # refused (the cap, a project limit, the model no longer served): no orphaned input
        _delete_quietly(ctx, project_id, file.id)
        raise
    if batch.input_file_id != file.id:  # the same key raced us and won: its batch, and no second file
        delete_file(ctx, project_id, file.id)
    log.info("batch %s retries %d requests of %s", batch.id, count, bid)
    return batch


_capped_retries = [threading.Lock() for _ in range(64)]  # by original: this process's (SQLite locks no row)


@contextmanager
def _one_capped_retry_at_a_time(ctx: Context, original: Batch) -> Iterator[None]:
    """Held while a retry of a batch with a ``max_cost`` reads what the cap leaves and creates
    itself, so two retries at once are not both given the same remainder: a lock in this process,
    and the original's row lock (PostgreSQL) for retries through other API processes."""
    if original.max_cost is None:
        yield
        return
    local = _capped_retries[int(hashlib.sha256(original.id.encode()).hexdigest(), 16) % len(_capped_retries)]
    with local, ctx.sessions() as session:
        session.execute(select(Batch.id).where(Batch.id == original.id).with_for_update())
        yield  # the session's end (a rollback: it wrote nothing) releases the row


def _delete_quietly(ctx: Context, project_id: str, fid: str) -> None:
    """Delete a retry's input that no batch took; a failure is logged, not raised over the refusal."""
    try:
        delete_file(ctx, project_id, fid)
    except Exception:
        log.exception("could not delete %s, the input of a refused retry", fid)


def _unspent_or_refuse(ctx: Context, original: Batch) -> Decimal | None:
    """``_unspent``, or 409 ``max_cost_reached`` where nothing is left."""
    budget = _unspent(ctx, original)
    if budget is not None and budget <= 0:
        raise Conflict(f"Batch {original.id} and its retries have spent or been given its max_cost of "
                       f"{format_amount(original.max_cost)} {original.currency}; a retry would spend more. Retry "
                       "its latest retry, or create a batch with a max_cost of its own.", "batch_id",
                       code=str(ErrorCode.MAX_COST_REACHED))
    return budget


def _unspent(ctx: Context, original: Batch) -> Decimal | None:
    """What the original's ``max_cost`` leaves for a retry: the cap less its own cost and less the
    cap of each earlier retry of it (a retry's cap bounds it and its own retries), so a batch and
    all its retries together stay within the cap however often it is retried, but for what each
    spends past its own cap as it stops (``spend_cap``). None: no cap."""
    if original.max_cost is None:
        return None
    with ctx.sessions() as session:
        given = session.scalar(select(func.coalesce(func.sum(Batch.max_cost), 0)).where(
            Batch.retry_of == original.id, Batch.project_id == original.project_id))
    return original.max_cost - cost(original).amount - Decimal(given)


def _write_input(ctx: Context, original: Batch, out) -> int:
    """Write the original's input lines to retry to ``out``; returns how many."""
    if original.status == BatchStatus.FAILED and original.error_file_id is None:
        raise InvalidRequest(f"Batch {original.id} failed validation and ran no request; fix its input file and "
                             "create a new batch.", "batch_id", code="nothing_to_retry")
    ran = original.output_file_id is not None or original.in_progress_at is not None
    if ran and original.error_file_id is None:
        return 0  # every request succeeded
    shards = _shard_outcomes(ctx, original) if ran else None
    count = 0
    for number, content in _input_lines(ctx, original):
        if shards is None or shards.unfinished(number, content):
            out.write(content + b"\n")
            count += 1
    return count


@dataclass(frozen=True)
class _Shard:
    first_line: int
    last_line: int
    failed: bool  # some of its requests did not succeed
    succeeded: frozenset[str | None] = frozenset()  # the custom_ids in its output, when some did
    lines: tuple[int, ...] | None = None  # its own lines, where its range holds other models' (``Shard.lines``)


class _ShardOutcomes:
    """Which requests of a batch that ran did not succeed, by their line in the input: a line of
    a shard with failures is retried unless the shard's output holds its result. By line, not by
    the error file's ``custom_id``: a shard the sweeper closed whose input it could not read
    back names its requests ``null``, and those are retried too. Only a shard that both
    succeeded and failed has its output read (a succeeded line always carries its ``custom_id``)."""

    def __init__(self, shards: list[_Shard]):
        self.by_line = {line: s for s in shards if s.lines is not None for line in s.lines}
        self.shards = [s for s in shards if s.lines is None]  # contiguous runs, in line order
        self.firsts = [s.first_line for s in self.shards]

    def unfinished(self, number: int, content: bytes) -> bool:
        shard = self.by_line.get(number)
        if shard is None:
            at = bisect_right(self.firsts, number) - 1
            if at < 0 or number > self.shards[at].last_line:
                return False  # in no shard: not a request of the batch
            shard = self.shards[at]
        return shard.failed and (not shard.succeeded or _custom_id(content) not in shard.succeeded)


def _shard_outcomes(ctx: Context, original: Batch) -> _ShardOutcomes:
    with ctx.sessions() as session:
        rows = session.execute(
            select(Shard.id, Shard.first_line, Shard.last_line, Shard.status, Shard.completed_count,
                   Shard.failed_count, Shard.output_key, Shard.lines)
            .where(Shard.batch_id == original.id).order_by(Shard.first_line)
        ).all()
        with_rows = request_results.shards_with_rows(session, original.id)
    shards = []
    for sid, first, last, status, completed, failed, output_key, lines in rows:
        own = tuple(lines) if lines is not None else None
        if status not in DONE_SHARDS or not completed:  # none of it succeeded (or it never ended)
            shards.append(_Shard(first, last, True, lines=own))
        elif not failed:
            shards.append(_Shard(first, last, False, lines=own))
        else:
            output = request_results.shard_lines(ctx, sid, output_key, True, sid in with_rows)
            shards.append(_Shard(first, last, True, frozenset(_result_ids(output)), own))
    return _ShardOutcomes(shards)


def _result_ids(chunks: Iterator[bytes]) -> Iterator[str | None]:
    for number, _, _, content in iter_lines(chunks):
        if not is_blank(content):
            yield peek_line(content, number).custom_id  # a result line the service wrote


def _input_lines(ctx: Context, original: Batch) -> Iterator[tuple[int, bytes]]:
    chunks = _content(ctx, original, original.input_file_id, "input")
    for number, _, _, content in iter_lines(chunks, ctx.settings.max_line_bytes):
        if isinstance(content, LongLine) or is_blank(content):
            continue  # a line validation refused as a whole never reaches the error file
        yield number, strip_bom(content, number)


def _custom_id(content: bytes) -> str | None:
    fields = peek_line(content, 0)  # the BOM is off already
    return fields.custom_id if fields is not None else None


def _content(ctx: Context, original: Batch, file_id: str, what: str) -> Iterator[bytes]:
    try:
        with ctx.sessions() as session:
            key = get_file_row(session, original.project_id, file_id).storage_key
    except NotFound:
        raise NotFound(f"The {what} file {file_id} of batch {original.id} was deleted or has expired; its "
                       "requests cannot be retried.", "batch_id") from None
    return ctx.storage.iter_chunks(key)

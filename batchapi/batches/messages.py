"""Anthropic Message Batches on the one batch machinery: create, retrieve, list, cancel, delete, results.

A Message Batch is an ordinary batch row whose endpoint is ``/v1/messages``: the API writes its
requests as an input file (one line per request, ``{"custom_id", "method": "POST", "url":
"/v1/messages", "body": params}``) through the Files service, and validation, shards, workers,
usage and cost are those of every batch. Each request runs on the model its ``params`` name: a
batch whose requests name several served models has shards per model, and is priced per model.
Its id is the row's under Anthropic's prefix (``batch_X`` is ``msgbatch_X``). The results are
the batch's stored output and error lines in Anthropic's shape (``openai.message_results``); a
batch that ended before any shard ran (it failed validation, or was cancelled or expired while
validating) has each request of its input ended with the batch's reason. Deleting a batch removes its files and results but keeps the row, marked
``deleted_at``, so that what it was billed stays in the usage and cost reports; every route here
then finds no such batch.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from sqlalchemy import delete as sql_delete
from sqlalchemy import select

from batchapi.batches import service
from batchapi.batches.files import delete_file, upload_file
from batchapi.batches.states import TERMINAL, BatchStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch, File, RequestResult, Shard
from batchapi.db.session import session_scope
from batchapi.errors import TRANSIENT, Conflict, InvalidRequest, NotFound
from batchapi.openai.body import MESSAGES
from batchapi.openai.lines import is_blank, iter_lines, peek_line
from batchapi.openai.message_requests import Written, line_head, read_requests
from batchapi.openai.message_results import dump, error_result, result_lines
from batchapi.storage.streams import TooLarge

PREFIX, ROW_PREFIX = "msgbatch_", "batch_"
# Anthropic's limits on one Message Batch, whatever the limits on files uploaded to /v1/files
MAX_REQUESTS = 100_000
MAX_BODY_BYTES = 256 * 1024 * 1024
WINDOW = "24h"
# what a request of a batch that ended before it ran ends as
NOTHING_TO_CANCEL = TERMINAL | {BatchStatus.FINALIZING}
UNRUN = {BatchStatus.CANCELLED: {"type": "canceled"}, BatchStatus.EXPIRED: {"type": "expired"}}


def public_id(row_id: str) -> str:
    return PREFIX + row_id.removeprefix(ROW_PREFIX)


def _row_id(message_batch_id: str) -> str:
    if not message_batch_id.startswith(PREFIX):
        raise _not_found(message_batch_id)
    return ROW_PREFIX + message_batch_id.removeprefix(PREFIX)


def _not_found(message_batch_id: str) -> NotFound:
    return NotFound(f"No message batch found with id '{message_batch_id}'.", "message_batch_id")


def input_lines(ctx: Context, body: BinaryIO | dict) -> tuple[bytes, int]:
    """The input file of a create request's body, and its number of requests (``create`` writes
    it to a temporary file instead)."""
    out = io.BytesIO()
    count = _write_input(ctx, body, out).count
    return out.getvalue(), count


def _write_input(ctx: Context, body: BinaryIO | dict, out: BinaryIO) -> Written:
    """Read ``body`` (the raw JSON, seekable, or its parsed object) into ``out``: a malformed envelope
    (not custom_id and params, a custom_id repeated) or a request past ``max_line_bytes`` refuses
    the whole request; a problem inside ``params`` is left to that request's result."""
    source = body if hasattr(body, "read") else io.BytesIO(json.dumps(body).encode())
    limit = max_file_bytes()
    written = read_requests(source, out, ctx.settings.max_line_bytes, MAX_REQUESTS, limit)
    if written.file_bytes > limit:  # a body within MAX_BODY_BYTES whose numbers grow when written again (1e9)
        raise TooLarge(f"requests: the {written.count} requests are {written.file_bytes} bytes as an input file; "
                       f"the limit is {limit}", "requests")
    return written


def max_file_bytes() -> int:
    """The largest input file a create body within ``MAX_BODY_BYTES`` becomes: the body's bytes and
    what each request's line adds to it (its method and url, ``body`` for ``params``)."""
    wrapper = len(line_head("")) - len(b'{"custom_id":"","params":')
    return MAX_BODY_BYTES + MAX_REQUESTS * wrapper


def create(ctx: Context, project_id: str, body: BinaryIO | dict) -> Batch:
    """A new batch over the requests of ``body`` (as ``_write_input`` takes it), written as an input
    file; a refused create leaves no file."""
    with tempfile.TemporaryFile() as data:
        written = _write_input(ctx, body, data)
        data.seek(0)
        file = upload_file(ctx, project_id, "message_batch_requests.jsonl", "batch", data,
                           max_bytes=max_file_bytes())
    try:
        return service.create_batch(ctx, project_id, file.id, MESSAGES, WINDOW, request_total=written.count,
                                    request_models=written.models)
    except Exception:  # refused, or the database away: the client retries with a new file
        with contextlib.suppress(NotFound, *TRANSIENT):  # gone already, or left for the file expiry
            if not _has_batch(ctx, file.id):  # an error after the batch's commit leaves a live batch its input
                delete_file(ctx, project_id, file.id)
        raise


def _has_batch(ctx: Context, file_id: str) -> bool:
    with ctx.sessions() as session:
        return session.scalar(select(Batch.id).where(Batch.input_file_id == file_id).limit(1)) is not None


def _row(session, project_id: str, message_batch_id: str, *, deleted: bool = False) -> Batch:
    """The project's Message Batch; NotFound for any other, and for a deleted one unless ``deleted``
    (a listing's cursor: a batch deleted since still marks its place)."""
    batch = session.get(Batch, _row_id(message_batch_id))
    if (batch is None or batch.project_id != project_id or batch.endpoint != MESSAGES
            or (batch.deleted_at is not None and not deleted)):
        raise _not_found(message_batch_id)
    return batch


def get(ctx: Context, project_id: str, message_batch_id: str) -> Batch:
    with ctx.sessions() as session:
        return _row(session, project_id, message_batch_id)


def list_page(ctx: Context, project_id: str, limit: int, after_id: str | None,
              before_id: str | None) -> tuple[list[Batch], bool]:
    """Newest first, as Anthropic lists: ``after_id`` pages to older batches, ``before_id`` to the
    ``limit`` newer ones just before it; whether more follow in that direction."""
    before_id, after_id = before_id or None, after_id or None  # an empty cursor is none
    if after_id is not None and before_id is not None:
        raise InvalidRequest("give at most one of before_id and after_id", "before_id")
    cursor = before_id or after_id
    if cursor is not None:
        with ctx.sessions() as session:
            cursor = _row(session, project_id, cursor, deleted=True).id
    rows, more = service.list_batches(ctx, project_id, limit, cursor, endpoint=MESSAGES,
                                      newest_first=before_id is None)  # deleted batches left out
    return (rows[::-1] if before_id is not None else rows), more


def cancel(ctx: Context, project_id: str, message_batch_id: str) -> Batch:
    """Cancel; a batch that already ended is returned as it is, as Anthropic does, and so is one
    whose every request has ended (its results being gathered, still ``in_progress`` to
    Anthropic's client): there is nothing left to cut short, here or if it ends meanwhile."""
    batch = get(ctx, project_id, message_batch_id)
    if batch.status in NOTHING_TO_CANCEL:
        return batch
    try:
        return service.cancel_batch(ctx, project_id, batch.id)
    except Conflict:
        batch = get(ctx, project_id, message_batch_id)
        if batch.status in NOTHING_TO_CANCEL:
            return batch
        raise


def delete(ctx: Context, project_id: str, message_batch_id: str) -> str:
    """Remove an ended batch: its files, shards and their objects. The row stays, marked
    ``deleted_at``, with its counts and usage: the reports still bill what it used."""
    with session_scope(ctx.sessions) as session:
        batch = _row(session, project_id, message_batch_id)
        if batch.status not in TERMINAL:
            raise InvalidRequest(f"Message batch {message_batch_id} has not ended yet; cancel it first, and delete "
                                 "it once processing_status is 'ended'.", "message_batch_id")
        file_ids = [f for f in (batch.input_file_id, batch.output_file_id, batch.error_file_id) if f]
        files = list(session.scalars(select(File).where(File.id.in_(file_ids), File.deleted_at.is_(None))))
        shards = session.execute(select(Shard.output_key, Shard.error_key).where(Shard.batch_id == batch.id)).all()
        keys = [f.storage_key for f in files] + [k for pair in shards for k in pair if k]
        for file in files:
            file.deleted_at = now()
        shard_ids = select(Shard.id).where(Shard.batch_id == batch.id)
        session.execute(sql_delete(RequestResult).where(RequestResult.shard_id.in_(shard_ids)))
        session.execute(sql_delete(Shard).where(Shard.batch_id == batch.id))
        batch.deleted_at = now()
        batch.idempotency_key = None  # free for a new batch, as when the row went
    for key in keys:
        ctx.storage.delete(key)
    return message_batch_id


def iter_results(ctx: Context, project_id: str, message_batch_id: str) -> Iterator[bytes]:
    """The results of an ended batch, one JSONL line per request: output lines, then error lines."""
    batch = get(ctx, project_id, message_batch_id)
    if batch.status not in TERMINAL:
        raise InvalidRequest(f"Message batch {message_batch_id} is still processing; its results are available "
                             "once processing_status is 'ended'.", "message_batch_id")
    with ctx.sessions() as session:
        ids = [f for f in (batch.output_file_id, batch.error_file_id) if f]
        live = select(File).where(File.id.in_(ids), File.deleted_at.is_(None))
        keys = {f.id: f.storage_key for f in session.scalars(live)}
        source = session.get(File, batch.input_file_id)
        input_key = source.storage_key if source is not None and source.deleted_at is None else None
    gone = NotFound(f"The results of message batch {message_batch_id} were deleted.", "message_batch_id")
    if len(keys) < len(ids) or (not ids and input_key is None):
        raise gone  # before the stream starts: a 404, never a 200 cut short
    if not ids:
        return _unrun_results(ctx, batch, input_key)
    return _stored_results(ctx, [keys[f] for f in ids])


def _stored_results(ctx: Context, keys: list[str]) -> Iterator[bytes]:
    for key in keys:
        lines = (content for _, _, _, content in iter_lines(ctx.storage.iter_chunks(key)))
        yield from result_lines(lines)


def _unrun_results(ctx: Context, batch: Batch, input_key: str) -> Iterator[bytes]:
    """Every request of a batch that ended before running any: ended with the batch's reason."""
    result = UNRUN.get(BatchStatus(batch.status)) or error_result(_failure(batch))
    for number, _, _, content in iter_lines(ctx.storage.iter_chunks(input_key)):
        fields = None if is_blank(content) else peek_line(content, number)
        if fields is not None and fields.custom_id is not None:  # a line without one has no result to give
            yield dump({"custom_id": fields.custom_id, "result": result})


def _failure(batch: Batch) -> str:
    errors = (batch.errors or {}).get("data") or [{}]
    first = errors[0]
    line = f" (request {first['line']})" if first.get("line") else ""
    return f"The batch failed validation{line}: {first.get('message', 'unknown error')}"

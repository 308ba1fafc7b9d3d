"""Retry (an extension, docs/API_EXTENSIONS.md): a new batch over exactly the requests of an ended
batch that did not succeed: those in its error file (failed, expired, cancelled), or, for a batch
that ended before running any, every request of its input.

The new batch's input file holds those lines as the original input held them, in input order;
its endpoint, completion window, metadata and ``output_expires_after`` are the original's, and
``retry_of`` names it. An ``Idempotency-Key`` makes the call safe to repeat: the key is stored on the new batch, so the same
key gets the same batch back, across restarts too.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator

from batchapi.batches import service
from batchapi.batches.context import Jobs
from batchapi.batches.files import delete_file, get_file_row, upload_file
from batchapi.batches.states import TERMINAL, BatchStatus
from batchapi.db.models import Batch
from batchapi.errors import Conflict, InvalidRequest, NotFound
from batchapi.openai.lines import BOM, LongLine, is_blank, iter_lines
from batchapi.openai.text import check_text

log = logging.getLogger(__name__)

SPOOL_BYTES = 16 * 1024 * 1024  # a retry's input is built in memory up to this, then on disk


def retry_batch(jobs: Jobs, project_id: str, bid: str, idempotency_key: str | None = None) -> Batch:
    check_text(idempotency_key, "Idempotency-Key")
    original = service.get_batch(jobs, project_id, bid)
    if original.status not in TERMINAL:
        raise Conflict(f"Cannot retry a batch with status '{original.status}': only a batch that has ended "
                       "(completed, failed, expired or cancelled) can be retried.", "batch_id", code="invalid_state")
    if idempotency_key is not None:
        existing = service.by_idempotency_key(jobs, project_id, idempotency_key, service.retry_fingerprint(bid))
        if existing is not None:
            return existing
    with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
        count = _write_input(jobs, original, spool)
        if not count:
            raise InvalidRequest(f"Batch {bid} has no failed, expired or cancelled requests to retry.", "batch_id",
                                 code="nothing_to_retry")
        spool.seek(0)
        file = upload_file(jobs, project_id, f"{bid}_retry.jsonl", "batch", spool)
    keep = original.output_expires_after  # its output files expire as the original's do
    batch = service.create_batch(jobs, project_id, file.id, original.endpoint, original.completion_window,
                                 original.metadata_, idempotency_key, retry_of=bid,
                                 output_expires_after={"anchor": "created_at", "seconds": keep} if keep else None)
    if batch.input_file_id != file.id:  # the same key raced us and won: its batch, and no second file
        delete_file(jobs, project_id, file.id)
    log.info("batch %s retries %d requests of %s", batch.id, count, bid)
    return batch


def _write_input(jobs: Jobs, original: Batch, out) -> int:
    """Write the original's input lines to retry to ``out``; returns how many."""
    if original.status == BatchStatus.FAILED and original.error_file_id is None:
        raise InvalidRequest(f"Batch {original.id} failed validation and ran no request; fix its input file and "
                             "create a new batch.", "batch_id", code="nothing_to_retry")
    wanted = _unfinished_ids(jobs, original)
    count = 0
    for content in _input_lines(jobs, original):
        if wanted is None or _custom_id(content) in wanted:
            out.write(content + b"\n")
            count += 1
    return count


def _unfinished_ids(jobs: Jobs, original: Batch) -> set[str] | None:
    """The custom_ids in the error file; None (all of them) for a batch that ended before running
    any request, an empty set for one with no error file."""
    if original.error_file_id is None:
        ran = original.output_file_id is not None or original.in_progress_at is not None
        return set() if ran else None
    ids: set[str] = set()
    for _, _, _, content in iter_lines(_content(jobs, original, original.error_file_id, "error")):
        if not is_blank(content):
            custom_id = json.loads(content).get("custom_id")
            if custom_id is not None:
                ids.add(custom_id)
    return ids


def _input_lines(jobs: Jobs, original: Batch) -> Iterator[bytes]:
    chunks = _content(jobs, original, original.input_file_id, "input")
    for number, _, _, content in iter_lines(chunks, jobs.settings.max_line_bytes):
        if isinstance(content, LongLine) or is_blank(content):
            continue  # a line validation refused as a whole never reaches the error file
        yield content.removeprefix(BOM.encode()) if number == 1 else content


def _custom_id(content: bytes) -> str | None:
    try:
        record = json.loads(content)
    except ValueError:
        return None
    return record.get("custom_id") if isinstance(record, dict) else None


def _content(jobs: Jobs, original: Batch, file_id: str, what: str) -> Iterator[bytes]:
    try:
        with jobs.sessions() as session:
            key = get_file_row(session, original.project_id, file_id).storage_key
    except NotFound:
        raise NotFound(f"The {what} file {file_id} of batch {original.id} was deleted or has expired; its "
                       "requests cannot be retried.", "batch_id") from None
    return jobs.storage.iter_chunks(key)

"""One side of a diff: an ended batch's results (its output and error files, which finalize wrote
from every shard and from the request results the sweeper kept) and its requests (its input
file), read as streams of lines, never whole."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass

from batchapi.batches import service
from batchapi.batches.diff.outcomes import Outcome, read_outcome
from batchapi.batches.files import get_file_row
from batchapi.batches.messages import PREFIX, ROW_PREFIX
from batchapi.batches.states import TERMINAL, BatchStatus
from batchapi.context import Context
from batchapi.db.models import Batch
from batchapi.errors import Conflict, NotFound
from batchapi.openai.body import parse_body
from batchapi.openai.embeddings import EMBEDDINGS
from batchapi.openai.errors import RequestError
from batchapi.openai.lines import LongLine, is_blank, iter_lines, strip_bom


@dataclass(frozen=True)
class Run:
    """An ended batch and the storage keys of its files (None: that file does not exist, or for
    the input, can no longer be read)."""

    batch: Batch
    result_keys: tuple[str, ...]  # the output file's, then the error file's
    input_key: str | None


@dataclass(frozen=True)
class Request:
    digest: bytes  # of its body: two runs asked the same when equal
    deterministic: bool  # greedy, seeded, or an embedding: the same configuration gives the same output


def open_run(ctx: Context, project_id: str, batch_id: str, param: str) -> Run:
    """The project's ended batch ``batch_id`` (a Message Batch's ``msgbatch_`` id too): NotFound for
    another project's or one whose result files were deleted or have expired, Conflict for one still
    running or that ran nothing."""
    row_id = ROW_PREFIX + batch_id.removeprefix(PREFIX) if batch_id.startswith(PREFIX) else batch_id
    with ctx.sessions() as session:
        try:
            batch = service.get_batch_row(session, project_id, row_id)
        except NotFound as exc:
            raise NotFound(exc.message, param) from None
        if batch.status not in TERMINAL:
            raise Conflict(f"Batch {batch_id} is {batch.status}: only a batch that has ended (completed, failed, "
                           "expired or cancelled) can be compared.", param, code="invalid_state")
        if batch.status == BatchStatus.FAILED and batch.output_file_id is None and batch.error_file_id is None:
            raise Conflict(f"Batch {batch_id} failed validation and ran no request; there are no results to "
                           "compare.", param, code="invalid_state")
        keys = []
        for what, file_id in (("output", batch.output_file_id), ("error", batch.error_file_id)):
            if file_id is None:
                continue
            try:
                keys.append(get_file_row(session, project_id, file_id).storage_key)
            except NotFound:
                raise NotFound(f"The {what} file {file_id} of batch {batch_id} was deleted or has expired; its "
                               "results cannot be compared.", param) from None
        try:
            input_key = get_file_row(session, project_id, batch.input_file_id).storage_key
        except NotFound:
            input_key = None
    return Run(batch, tuple(keys), input_key)


def outcomes(ctx: Context, run: Run, only: Container[str] | None = None) -> Iterator[Outcome]:
    """Every result of the batch: its output lines, then its error lines, each in input order;
    with ``only``, the results of those ``custom_id``s (and any whose id is not read at a glance)."""
    for key in run.result_keys:
        for _, _, _, content in iter_lines(ctx.storage.iter_chunks(key)):
            if is_blank(content):
                continue
            if only is not None:
                named = _RENDERED_ID.match(content)  # the renderer's line starts so: no need to parse the rest
                if named is not None and named.group(1).decode("utf-8", "replace") not in only:
                    continue
            yield read_outcome(content)


# the start of a line ``openai.render`` wrote, up to a custom_id without escapes (a JSON string
# holds no bare quote, so these bytes are the line's own keys)
_RENDERED_ID = re.compile(rb'\{"id":"[^"\\]*","custom_id":"([^"\\]*)"')


def requests(ctx: Context, run: Run) -> dict[str, Request] | None:
    """What each request of the batch asked, by ``custom_id``; None when its input file is gone."""
    if run.input_key is None:
        return None
    found: dict[str, Request] = {}
    try:
        for number, _, _, content in iter_lines(ctx.storage.iter_chunks(run.input_key), ctx.settings.max_line_bytes):
            if isinstance(content, LongLine) or is_blank(content):
                continue  # refused as a whole: it has no result to compare
            request = _request(strip_bom(content, number), run.batch.endpoint)
            if request is not None:
                found[request[0]] = request[1]
    except NotFound:  # the object went with the file meanwhile
        return None
    return found


def _request(content: bytes, endpoint: str) -> tuple[str, Request] | None:
    try:
        record = json.loads(content)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
        return None
    body = record.get("body")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return record["custom_id"], Request(digest, _deterministic(endpoint, body))


def _deterministic(endpoint: str, body: object) -> bool:
    """Whether the request's output is fixed by its configuration: an embedding, a greedy draw
    (temperature 0 or top_k 1) or a seeded one (a seeded row draws from a hash of its seed)."""
    if endpoint == EMBEDDINGS:
        return True
    try:
        parsed = parse_body(endpoint, body)
    except RequestError:
        return False  # refused: it has no output to compare
    return parsed.temperature == 0 or parsed.top_k == 1 or parsed.seed is not None

"""The Batches service: create (idempotently), retrieve, list, cancel, partial results."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchapi.batches import request_results, states
from batchapi.batches.billing import new_per_model, price_for
from batchapi.batches.files import expiry_seconds, get_file_row
from batchapi.batches.sharing import quotas
from batchapi.batches.states import DONE_SHARDS, BatchStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.ids import batch_id as new_batch_id
from batchapi.db.models import Batch, Shard
from batchapi.db.paging import page
from batchapi.db.session import session_scope
from batchapi.errors import Conflict, InvalidRequest, NotFound
from batchapi.models.registry import require_served, served_id_for, served_model_id
from batchapi.models.store import CHAT
from batchapi.openai.body import ENDPOINTS, MESSAGES
from batchapi.openai.lines import LongLine, is_blank, iter_lines, peek_line
from batchapi.openai.text import check_text

log = logging.getLogger(__name__)

WINDOW = re.compile(r"^([1-9][0-9]*)(h|d)$")
MIN_WINDOW = 3600
MAX_WINDOW = 7 * 86400
MAX_METADATA_PAIRS = 16
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000  # a batch's order within its project (higher first)
MAX_COST = Decimal(10) ** 9
PARTIAL_KINDS = ("output", "error")


def window_seconds(window: str) -> int:
    """``"24h"`` -> 86400; windows from 1h to 7d, in hours or days."""
    match = WINDOW.match(window)
    if match is None:
        raise InvalidRequest(f"completion_window {window!r} must look like '24h' or '2d'", "completion_window")
    seconds = int(match.group(1)) * (3600 if match.group(2) == "h" else 86400)
    if not MIN_WINDOW <= seconds <= MAX_WINDOW:
        raise InvalidRequest("completion_window must be between 1h and 7d", "completion_window")
    return seconds


def check_metadata(metadata: dict | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if not isinstance(key, str) or not 0 < len(key) <= 64:
            raise InvalidRequest("metadata keys must be strings of 1 to 64 characters", "metadata")
        check_text(key, "metadata")
        if not isinstance(value, str) or len(value) > 512:
            raise InvalidRequest(f"metadata[{key!r}] must be a string of at most 512 characters", "metadata")
        check_text(value, "metadata")


def check_scheduling(priority: int, max_cost: Decimal | None) -> None:
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}", "priority")
    if max_cost is not None and not (max_cost.is_finite() and 0 < max_cost < MAX_COST):
        raise InvalidRequest(f"max_cost must be a positive amount below {MAX_COST} in the batch's currency",
                             "max_cost")


def _fingerprint(input_file_id: str, endpoint: str, window: str, metadata: dict | None, priority: int = 0,
                 max_cost: Decimal | None = None) -> str:
    fields = [input_file_id, endpoint, window, metadata]
    if priority or max_cost is not None:  # keys made before these fields keep their fingerprints
        fields += [priority, None if max_cost is None else str(max_cost.normalize())]
    canonical = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_batch(
    ctx: Context,
    project_id: str,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict | None = None,
    idempotency_key: str | None = None,
    request_total: int = 0,
    retry_of: str | None = None,
    output_expires_after: dict | None = None,
    request_models: list[str | None] | None = None,
    result_cache: bool = True,
    priority: int = 0,
    max_cost: Decimal | None = None,
) -> Batch:
    """A new ``validating`` batch (validation starts after the commit), or, for a repeated
    ``idempotency_key`` with the same parameters, the batch the first request created.
    ``request_total``: the requests already known to be in the file (a Message Batch's), which
    validation confirms. ``retry_of``: the batch whose unfinished requests the file holds
    (``retry.retry_batch``); a retry's key stands for that batch, whatever the new file.
    ``request_models``: the model each request names, where the caller has them (a Message Batch's
    create body), so that the file is not read again to find them. ``result_cache``: False to
    run every request of the batch, none answered from the result cache (``result_cache``).
    ``priority``: its order among its project's batches (``fair_share``). ``max_cost``: a spend cap
    in the batch's currency; reaching it stops the batch as a cancel does (``spend_cap``)."""
    for value, param in ((input_file_id, "input_file_id"), (idempotency_key, "Idempotency-Key")):
        check_text(value, param)
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint {endpoint!r} is not supported; expected one of {list(ENDPOINTS)}", "endpoint")
    seconds = window_seconds(completion_window)
    check_metadata(metadata)
    check_scheduling(priority, max_cost)
    output_expiry = expiry_seconds(output_expires_after, "output_expires_after")  # of the output and error files
    fingerprint = retry_fingerprint(retry_of) if retry_of else _fingerprint(
        input_file_id, endpoint, completion_window, metadata, priority, max_cost)
    if idempotency_key is not None:
        existing = by_idempotency_key(ctx, project_id, idempotency_key, fingerprint)
        if existing is not None:
            return _same_expiry(existing, output_expiry, retry_of)
    models = batch_models(ctx, project_id, input_file_id, each_request=endpoint == MESSAGES, named=request_models)
    model = models[0] if models else None
    if endpoint == MESSAGES:  # Anthropic refuses at create while the project's queue is full
        with ctx.sessions() as session:
            quotas.check_create(session, ctx.settings, project_id, [m for m in models if m] or [served_model_id(ctx.settings)])
    price = price_for(ctx.settings, model or served_model_id(ctx.settings))
    t = now()
    try:
        with session_scope(ctx.sessions) as session:
            batch = Batch(
                id=new_batch_id(), project_id=project_id, endpoint=endpoint, input_file_id=input_file_id,
                completion_window=completion_window, status=BatchStatus.VALIDATING, metadata_=metadata,
                idempotency_key=idempotency_key, request_fingerprint=fingerprint, created_at=t,
                expires_at=t + seconds, validation_lease_expires_at=t + ctx.settings.validation_lease_seconds,
                currency=price.currency, price_input=price.input, price_cached_input=price.cached_input,
                price_output=price.output, discount_percent=ctx.settings.batch_discount_percent,
                request_total=request_total, model=model, retry_of=retry_of, output_expires_after=output_expiry,
                per_model=new_per_model(ctx.settings, models), result_cache=result_cache,
                priority=priority, max_cost=max_cost,
            )
            session.add(batch)
            session.flush()
            # checked after the batch is in (and locked until it commits), so the sweeper's file
            # expiry either sees the batch using the file or has removed the file before: then
            # this create fails with NotFound and nothing of it stays
            file = get_file_row(session, project_id, input_file_id, lock=True)
            if file.purpose != "batch":
                raise InvalidRequest(f"file {input_file_id} has purpose {file.purpose!r}, not 'batch'", "input_file_id")
    except IntegrityError:  # the same key raced us and won
        existing = by_idempotency_key(ctx, project_id, idempotency_key, fingerprint)
        if existing is None:
            raise
        return _same_expiry(existing, output_expiry, retry_of)
    if ctx.on_batch_created is not None:
        ctx.on_batch_created(batch.id)
    return batch


def batch_models(ctx: Context, project_id: str, input_file_id: str, each_request: bool = False,
                 named: list[str | None] | None = None) -> list[str]:
    """The served models the batch runs on, priced at create: the first is the batch's model.
    One model, the one the file's first request names: ``ModelNotServed`` (``model_not_found``)
    when no worker serves it; none when the first line names no model (validation reports what
    is wrong with it). ``each_request`` (a Message Batch: Anthropic validates each request
    alone, and runs each on its own model): every served chat model a request names (``named``,
    else read from the file), in the order they first appear; a request naming a model not
    served is only that request's error; none when no request names a served one (the default
    model's workers then refuse each request)."""
    if named is None:
        with ctx.sessions() as session:
            storage_key = get_file_row(session, project_id, input_file_id).storage_key
        named = _models(ctx, storage_key) if each_request else [next(_models(ctx, storage_key), None)]
    if each_request:
        served = (served_id_for(ctx.settings, name, CHAT) for name in named if isinstance(name, str))
        return list(dict.fromkeys(filter(None, served)))
    first = next(iter(named), None)
    if first is None:
        return []
    return [require_served(ctx.settings, first, "input_file_id", "of the file's first request")]


def _models(ctx: Context, storage_key: str) -> Iterator[str | None]:
    """The model each request line names, in order (None for a line that names none); stops at a
    line that is not JSON, or with no content: validation says what is wrong there."""
    try:
        for number, _start, _end, content in iter_lines(ctx.storage.iter_chunks(storage_key),
                                                        ctx.settings.max_line_bytes):
            if isinstance(content, LongLine) or is_blank(content):
                continue
            fields = peek_line(content, number)
            if fields is None:
                return
            yield fields.model
    except NotFound:
        return


def retry_fingerprint(original_id: str) -> str:
    return hashlib.sha256(json.dumps(["retry", original_id]).encode()).hexdigest()


def by_idempotency_key(ctx: Context, project_id: str, key: str | None, fingerprint: str) -> Batch | None:
    """The batch created with ``key``; Conflict if it was created with other parameters."""
    with ctx.sessions() as session:
        batch = session.scalar(select(Batch).where(Batch.project_id == project_id, Batch.idempotency_key == key))
    if batch is not None and batch.request_fingerprint != fingerprint:
        raise _key_reused()
    return batch


def _same_expiry(batch: Batch, output_expiry: int | None, retry_of: str | None) -> Batch:
    """The output files' expiry is part of a create's parameters too; it is compared on the row, as
    fingerprints made before it counted lack it (a retry's follows its original's)."""
    if retry_of is None and batch.output_expires_after != output_expiry:
        raise _key_reused()
    return batch


def _key_reused() -> Conflict:
    return Conflict("this Idempotency-Key was already used with different parameters", "Idempotency-Key",
                    code="idempotency_key_reused")


def get_batch_row(session: Session, project_id: str, bid: str, *, deleted: bool = False) -> Batch:
    """The project's batch; NotFound for another project's and for a deleted Message Batch (its
    row stays for the reports only) unless ``deleted`` (a listing's cursor: it still marks its place)."""
    batch = session.get(Batch, bid)
    if batch is None or batch.project_id != project_id or (batch.deleted_at is not None and not deleted):
        raise batch_not_found(bid)
    return batch


def batch_not_found(bid: str) -> NotFound:
    return NotFound(f"No batch found with id '{bid}'.", "batch_id")


def get_batch(ctx: Context, project_id: str, bid: str) -> Batch:
    with ctx.sessions() as session:
        return get_batch_row(session, project_id, bid)


def list_batches(ctx: Context, project_id: str, limit: int, after: str | None, *, endpoint: str | None = None,
                 newest_first: bool = True) -> tuple[list[Batch], bool]:
    """Newest first; up to ``limit`` batches after the cursor ``after``, and whether more follow.
    ``endpoint`` keeps that endpoint's batches only; ``newest_first`` False pages oldest first."""
    with ctx.sessions() as session:
        cursor = get_batch_row(session, project_id, after, deleted=True) if after else None
        query = select(Batch).where(Batch.project_id == project_id, Batch.deleted_at.is_(None))
        if endpoint is not None:
            query = query.where(Batch.endpoint == endpoint)
        return page(session, query, Batch, cursor, limit, newest_first=newest_first)


def cancel_batch(ctx: Context, project_id: str, bid: str) -> Batch:
    """Move the batch to ``cancelling``; the workers (or the validator) finish the cancel."""
    with session_scope(ctx.sessions) as session:
        batch = get_batch_row(session, project_id, bid)
        status = batch.status
        moved = states.transition(session, bid, BatchStatus.CANCELLING)
    if not moved and status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        with ctx.sessions() as session:
            status = get_batch_row(session, project_id, bid).status
        if status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise Conflict(f"Cannot cancel a batch with status '{status}'.", "batch_id", code="invalid_state")
    if moved:
        ctx.dispatcher.batch_cancelled(bid)
        if ctx.on_batch_cancelled is not None:
            ctx.on_batch_cancelled(bid)
    return get_batch(ctx, project_id, bid)


def iter_partial_results(ctx: Context, project_id: str, bid: str, kind: str = "output") -> Iterator[bytes]:
    """The result lines of every request finished so far (the output or the error lines), in
    input order; the rest of the batch may still be running."""
    if kind not in PARTIAL_KINDS:
        raise InvalidRequest(f"kind must be one of {list(PARTIAL_KINDS)}", "kind")
    with ctx.sessions() as session:
        get_batch_row(session, project_id, bid)
        # rows first: a shard that completes between the two reads (its rows deleted as its
        # objects are recorded) is then seen done and read from its objects, not missed
        with_rows = request_results.shards_with_rows(session, bid)
        shards = session.execute(
            select(Shard.id, Shard.status, Shard.output_key, Shard.error_key)
            .where(Shard.batch_id == bid).order_by(Shard.index)
        ).all()
    return _partial(ctx, shards, with_rows, kind == "output")


def _partial(ctx: Context, shards, with_rows: set[str], succeeded: bool) -> Iterator[bytes]:
    for shard_id, status, output_key, error_key in shards:
        key = output_key if succeeded else error_key
        try:
            if status in DONE_SHARDS:
                yield from request_results.shard_lines(ctx, shard_id, key, succeeded, shard_id in with_rows)
            elif shard_id in with_rows:
                yield from _running(ctx, shard_id, succeeded)
        except NotFound:  # raised before any byte of it: a shard object not written yet
            log.warning("partial results: %s is missing", key)


def _running(ctx: Context, shard_id: str, succeeded: bool) -> Iterator[bytes]:
    """A running shard's finished lines; if it completed since (its rows moved into its
    objects), its objects."""
    rows = request_results.stored(ctx, shard_id)
    if rows:
        yield from request_results.running_lines(rows, succeeded)
        return
    with ctx.sessions() as session:
        shard = session.get(Shard, shard_id)
        if shard is not None and shard.status in DONE_SHARDS:
            key = shard.output_key if succeeded else shard.error_key
            yield from request_results.shard_lines(ctx, shard_id, key, succeeded, False)

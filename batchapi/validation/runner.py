"""Running validation: claim a ``validating`` batch, scan its file, record the outcome.

A claim is the batch's validation lease (``batches.leases``), so a validator that dies leaves
a batch that the sweeper hands to a live ``ValidationRunner`` once the lease runs out (at
start-up and on every sweep). The outcome is one transaction: the batch moves to
``in_progress`` together with its shard rows, or to ``failed`` with its errors; only after the
commit is the dispatcher told. Either way the problems of single request bodies are recorded
in ``request_errors`` (those requests run as 400s; a resumed validation scans again and
records the same).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import delete, select
from sqlalchemy.exc import OperationalError

from batchapi.batches import leases, messages, states
from batchapi.batches.billing import set_estimates
from batchapi.batches.sharing import quotas
from batchapi.batches.states import BatchStatus, ShardStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.ids import shard_id
from batchapi.db.models import Batch, File, Shard
from batchapi.db.session import session_scope
from batchapi.errors import NotFound, StorageError
from batchapi.models.registry import default_model_for, served_model
from batchapi.models.store import CHAT, EMBEDDING
from batchapi.openai.body import MESSAGES
from batchapi.openai.embeddings import EMBEDDINGS
from batchapi.openai.errors import ErrorCode
from batchapi.validation.backfill import batches_to_count, count_batch
from batchapi.validation.scanner import Limits, LineError, Scanner, ScanResult
from batchapi.validation.token_counts import counter_for

log = logging.getLogger(__name__)


def validate_batch(ctx: Context, batch_id: str) -> str:
    """Validate a batch whose lease this process holds; returns the status it ends in."""
    with ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return batch.status if batch else "missing"
        file = session.get(File, batch.input_file_id)
        endpoint, input_file_id = batch.endpoint, batch.input_file_id
        model = batch.model  # the first request's, found at create (None: it names none)
        more = [m for m in batch.per_model or () if m != model]  # a Message Batch's other models
    result = scan_file(ctx, file, input_file_id, endpoint, model, more, lambda scan: _renew(ctx, batch_id, scan))
    if isinstance(result, list):
        return _fail(ctx, batch_id, result)
    if result.errors:
        return _fail(ctx, batch_id, result.errors, result.request_report)
    return _start(ctx, batch_id, result)


def scan_file(ctx: Context, file: File | None, input_file_id: str, endpoint: str, model: str | None,
              more: list[str], renew=lambda scan: True) -> ScanResult | list[LineError]:
    """Scan ``file`` as a batch of ``endpoint`` on ``model`` (and ``more`` models) would run it:
    its result, or the one error that stops the scan before it starts (the file gone, too
    large or empty; the model not served). ``renew`` is called as the scan goes on; False stops it."""
    if file is None or file.deleted_at is not None:
        return [LineError(ErrorCode.FILE_NOT_FOUND, f"the input file {input_file_id} is gone")]
    try:
        size = ctx.storage.size(file.storage_key)
    except NotFound:
        return [LineError(ErrorCode.FILE_NOT_FOUND, "the input file's content is missing")]
    if endpoint == MESSAGES:  # written from a create body, within Anthropic's limits, not the upload's
        limit, max_lines = messages.max_file_bytes(), messages.MAX_REQUESTS
    else:
        limit, max_lines = ctx.settings.max_file_bytes, ctx.settings.max_file_lines
    if size > limit:
        return [LineError(ErrorCode.FILE_TOO_LARGE, f"the file is {size} bytes; the limit is {limit}")]
    if size == 0:
        return [LineError(ErrorCode.EMPTY_FILE, "the file is empty")]

    kind = EMBEDDING if endpoint == EMBEDDINGS else CHAT
    try:
        served = served_model(ctx.settings, model or default_model_for(ctx.settings, kind))
        others = [served_model(ctx.settings, m) for m in more]
    except LookupError as exc:  # the operator has not pulled the model: say so on the batch
        return [LineError(ErrorCode.MODEL_NOT_AVAILABLE, f"the served model is not available: {exc}")]
    if served.kind != kind:
        return [LineError(ErrorCode.MODEL_NOT_FOUND, f"the model {served.id!r} is {_a(served.kind)} model; {endpoint} "
                          f"needs {_a(kind)} model", None, "body.model")]
    limits = Limits(
        endpoint=endpoint, served_model=served.id, model_aliases=served.aliases,
        max_lines=max_lines, shard_size=ctx.settings.shard_size,
        max_line_bytes=ctx.settings.max_line_bytes, max_inputs=ctx.settings.max_embedding_inputs,
        thinking_key=ctx.settings.thinking_key(),
        more_models={m.id: m.aliases for m in others},
    )
    scanner = Scanner(limits, counter_for(served.path), {m.id: counter_for(m.path) for m in others})
    return scanner.scan(ctx.storage.iter_chunks(file.storage_key), renew)


def _a(kind: str) -> str:
    return f"an {kind}" if kind == EMBEDDING else f"a {kind}"


def _renew(ctx: Context, batch_id: str, scanner: Scanner) -> bool:
    """Extend the lease while the scan runs and show the estimate so far; False when the batch
    left ``validating``."""
    return leases.renew_validation(ctx, batch_id, estimated_input_tokens=scanner.prompt_tokens,
                                   estimated_output_tokens=scanner.output_tokens)


def _fail(ctx: Context, batch_id: str, errors: list[LineError], request_errors: dict | None = None) -> str:
    body = {"object": "list", "data": [e.as_dict() for e in errors]}
    with session_scope(ctx.sessions) as session:
        if states.transition(session, batch_id, BatchStatus.FAILED, sources={BatchStatus.VALIDATING}, errors=body,
                             request_errors=request_errors, validation_lease_expires_at=None):
            return BatchStatus.FAILED
    return leases.settle_cancelled_validation(ctx, batch_id)


def _start(ctx: Context, batch_id: str, result: ScanResult) -> str:
    """The batch to ``in_progress`` with its shards, or to ``failed`` when it is over its
    project's quota (checked in the same transaction, under the project's row lock)."""
    t = now()
    shard_ids = [shard_id(batch_id, plan.index) for plan in result.shards]
    with session_scope(ctx.sessions) as session:
        project_id, per_model = session.execute(
            select(Batch.project_id, Batch.per_model).where(Batch.id == batch_id)).one()
        over = quotas.refusal(session, ctx.settings, project_id, batch_id, result.enqueued())
        if over is not None:
            moved = states.transition(session, batch_id, BatchStatus.FAILED, sources={BatchStatus.VALIDATING},
                                      errors={"object": "list", "data": [LineError(*over).as_dict()]},
                                      request_errors=result.request_report, validation_lease_expires_at=None)
        else:
            estimates = {} if not per_model else {"per_model": set_estimates(per_model, result.estimates())}
            moved = states.transition(
                session, batch_id, BatchStatus.IN_PROGRESS, sources={BatchStatus.VALIDATING},
                model=result.model, request_total=result.request_count, validation_lease_expires_at=None,
                estimated_input_tokens=result.prompt_tokens, estimated_output_tokens=result.max_output_tokens,
                request_errors=result.request_report, **estimates,
            )
        if moved and over is None:
            session.execute(delete(Shard).where(Shard.batch_id == batch_id))
            session.add_all(
                Shard(
                    id=sid, batch_id=batch_id, index=plan.index, first_line=plan.first_line,
                    last_line=plan.last_line, start_byte=plan.start_byte, end_byte=plan.end_byte,
                    request_count=plan.request_count, prompt_tokens=plan.prompt_tokens,
                    estimated_output_tokens=plan.estimated_output_tokens, status=ShardStatus.QUEUED, created_at=t,
                    model=plan.model, lines=plan.lines,
                )
                for sid, plan in zip(shard_ids, result.shards, strict=True)
            )
    if moved and over is not None:
        log.info("batch %s refused: %s", batch_id, over[1])
        return BatchStatus.FAILED
    if not moved:
        return leases.settle_cancelled_validation(ctx, batch_id)
    log.info("batch %s valid: %d requests (%d refused for their body) in %d shards", batch_id, result.request_count,
             result.request_error_total, len(shard_ids))
    by_model: dict[str, list[str]] = {}
    for sid, plan in zip(shard_ids, result.shards, strict=True):
        by_model.setdefault(plan.model, []).append(sid)
    for model, ids in by_model.items():  # each model's shards to its workers
        ctx.dispatcher.batch_ready(batch_id, ids, model=model)
    return BatchStatus.IN_PROGRESS


def resume(ctx: Context, batch_id: str) -> bool:
    """Take over the validation of a batch whose validator died; False if another live one has it."""
    if not leases.claim_validation(ctx, batch_id, stale_only=True):
        return False
    log.warning("resuming the validation of batch %s", batch_id)
    run_claimed(ctx, batch_id)
    return True


def run_claimed(ctx: Context, batch_id: str) -> str:
    """Validate, and never let one batch's surprise kill the validator thread."""
    try:
        return validate_batch(ctx, batch_id)
    except (StorageError, OperationalError) as exc:  # transient: the lease runs out, a sweep retries
        log.warning("validation of batch %s interrupted, will retry: %s", batch_id, exc)
        return BatchStatus.VALIDATING
    except Exception:  # an unexpected bug: the batch fails with a message rather than hanging
        log.exception("validation of batch %s crashed", batch_id)
        return _fail(ctx, batch_id, [LineError(ErrorCode.VALIDATION_ERROR, "the file could not be validated (internal error)")])


class ValidationRunner:
    """Validates batches on a background thread of the API process and counts the prompt tokens
    of started ones on another (so counting a big batch never holds up the next validation).
    It is the sweeper's ``Validator``: the sweep hands it batches whose validator died and asks
    it to count what is left uncounted."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchapi-validate")
        self._counting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchapi-count")
        self._counting_now: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def submit(self, batch_id: str) -> None:
        """Validate ``batch_id``, whose lease was taken when it was created."""
        self._pool.submit(self._validate, batch_id)

    def resume(self, batch_id: str) -> None:
        """Validate ``batch_id`` if its lease is still stale when its turn comes."""
        self._pool.submit(self._resume, batch_id)

    def backfill(self) -> None:
        """Count the prompts of every started batch not counted yet."""
        for batch_id in batches_to_count(self.ctx):
            self._count(batch_id)

    def _validate(self, batch_id: str) -> None:
        if run_claimed(self.ctx, batch_id) == BatchStatus.IN_PROGRESS:
            self._count(batch_id)

    def _resume(self, batch_id: str) -> None:
        if not self._stop.is_set() and resume(self.ctx, batch_id):
            self._count(batch_id)

    def _count(self, batch_id: str) -> None:
        with self._lock:
            if batch_id in self._counting_now:
                return
            self._counting_now.add(batch_id)
        self._counting.submit(self._count_now, batch_id)

    def _count_now(self, batch_id: str) -> None:
        try:
            count_batch(self.ctx, batch_id, stop=self._stop.is_set)
        except Exception:  # the sweep tries again; counts are an estimate, never a gate
            log.exception("counting the prompt tokens of batch %s failed", batch_id)
        finally:
            with self._lock:
                self._counting_now.discard(batch_id)

    def shutdown(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._counting.shutdown(wait=True, cancel_futures=True)

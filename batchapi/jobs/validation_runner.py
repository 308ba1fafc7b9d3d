"""Running validation: claim a ``validating`` batch, scan its file, record the outcome.

A claim is a lease on the batch row (``validation_lease_expires_at``), taken with one
conditional UPDATE, so a validator that dies leaves a batch that ``resume_stale`` claims
again once the lease runs out (at start-up and on every sweep). The outcome is one
transaction: the batch moves to ``in_progress`` together with its shard rows, or to
``failed`` with its errors; only after the commit is the dispatcher told.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import delete, or_, select, update
from sqlalchemy.exc import OperationalError

from batchapi.jobs import states
from batchapi.jobs.context import Jobs
from batchapi.jobs.db import session_scope
from batchapi.jobs.errors import NotFound, StorageError
from batchapi.jobs.ids import now, shard_id
from batchapi.jobs.models import Batch, File, Shard
from batchapi.jobs.prompt_counting import batches_to_count, count_batch
from batchapi.jobs.prompt_tokens import counter_for
from batchapi.jobs.served_model import served_model
from batchapi.jobs.validation import Limits, LineError, Scanner, ScanResult

log = logging.getLogger(__name__)


def _lease_expired(t: int):
    return or_(Batch.validation_lease_expires_at.is_(None), Batch.validation_lease_expires_at < t)


def claim(jobs: Jobs, batch_id: str, *, stale_only: bool) -> bool:
    """Take the validation lease of ``batch_id``; with ``stale_only``, only an expired one."""
    t = now()
    query = update(Batch).where(Batch.id == batch_id, Batch.status == states.VALIDATING)
    if stale_only:
        query = query.where(_lease_expired(t))
    with session_scope(jobs.sessions) as session:
        result = session.execute(query.values(validation_lease_expires_at=t + jobs.settings.validation_lease_seconds))
        return result.rowcount == 1


def validate_batch(jobs: Jobs, batch_id: str) -> str:
    """Validate a batch whose lease this process holds; returns the status it ends in."""
    with jobs.sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != states.VALIDATING:
            return batch.status if batch else "missing"
        file = session.get(File, batch.input_file_id)
        endpoint = batch.endpoint
    if file is None or file.deleted_at is not None:
        return _fail(jobs, batch_id, [LineError("file_not_found", f"the input file {batch.input_file_id} is gone")])
    try:
        size = jobs.storage.size(file.storage_key)
    except NotFound:
        return _fail(jobs, batch_id, [LineError("file_not_found", "the input file's content is missing")])
    limit = jobs.settings.max_file_bytes
    if size > limit:
        return _fail(jobs, batch_id, [LineError("file_too_large", f"the file is {size} bytes; the limit is {limit}")])
    if size == 0:
        return _fail(jobs, batch_id, [LineError("empty_file", "the file is empty")])

    try:
        served = served_model(jobs.settings)
    except LookupError as exc:  # the operator has not pulled the model: say so on the batch
        return _fail(jobs, batch_id, [LineError("model_not_available", f"the served model is not available: {exc}")])
    limits = Limits(
        endpoint=endpoint, served_model=served.id, model_aliases=served.aliases,
        max_lines=jobs.settings.max_file_lines, shard_size=jobs.settings.shard_size,
    )
    scanner = Scanner(limits, counter_for(served.path))
    result = scanner.scan(jobs.storage.iter_chunks(file.storage_key), lambda scan: _renew(jobs, batch_id, scan))
    if result.errors:
        return _fail(jobs, batch_id, result.errors)
    return _start(jobs, batch_id, result)


def _renew(jobs: Jobs, batch_id: str, scanner: Scanner) -> bool:
    """Extend the lease while the scan runs and show the estimate so far; False when the batch
    left ``validating``."""
    with session_scope(jobs.sessions) as session:
        result = session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status == states.VALIDATING)
            .values(
                validation_lease_expires_at=now() + jobs.settings.validation_lease_seconds,
                estimated_input_tokens=scanner.prompt_tokens,
                estimated_output_tokens=scanner.output_tokens,
            )
        )
        return result.rowcount == 1


def _fail(jobs: Jobs, batch_id: str, errors: list[LineError]) -> str:
    body = {"object": "list", "data": [e.as_dict() for e in errors]}
    with session_scope(jobs.sessions) as session:
        if states.transition(session, batch_id, states.FAILED, sources={states.VALIDATING}, errors=body,
                             validation_lease_expires_at=None):
            return states.FAILED
    return _settle_cancel(jobs, batch_id)


def _start(jobs: Jobs, batch_id: str, result: ScanResult) -> str:
    t = now()
    shard_ids = [shard_id(batch_id, plan.index) for plan in result.shards]
    with session_scope(jobs.sessions) as session:
        moved = states.transition(
            session, batch_id, states.IN_PROGRESS, sources={states.VALIDATING},
            model=result.model, request_total=result.request_count, validation_lease_expires_at=None,
            estimated_input_tokens=result.prompt_tokens, estimated_output_tokens=result.max_output_tokens,
        )
        if moved:
            session.execute(delete(Shard).where(Shard.batch_id == batch_id))
            session.add_all(
                Shard(
                    id=sid, batch_id=batch_id, index=plan.index, first_line=plan.first_line,
                    last_line=plan.last_line, start_byte=plan.start_byte, end_byte=plan.end_byte,
                    request_count=plan.request_count, prompt_tokens=plan.prompt_tokens,
                    estimated_output_tokens=plan.estimated_output_tokens, status="queued", created_at=t,
                )
                for sid, plan in zip(shard_ids, result.shards, strict=True)
            )
    if not moved:
        return _settle_cancel(jobs, batch_id)
    log.info("batch %s valid: %d requests in %d shards", batch_id, result.request_count, len(shard_ids))
    jobs.dispatcher.batch_ready(batch_id, shard_ids)
    return states.IN_PROGRESS


def _settle_cancel(jobs: Jobs, batch_id: str) -> str:
    """The batch was cancelled while it was validating: nothing ran, so it is cancelled now."""
    with session_scope(jobs.sessions) as session:
        states.transition(session, batch_id, states.CANCELLED, validation_lease_expires_at=None)
        return session.scalar(select(Batch.status).where(Batch.id == batch_id)) or "missing"


def resume_stale(jobs: Jobs) -> list[str]:
    """Validate every batch whose validator died; settle cancels that came during validation."""
    t = now()
    with jobs.sessions() as session:
        stale = _lease_expired(t)
        validating = list(session.scalars(select(Batch.id).where(Batch.status == states.VALIDATING, stale)))
        cancelling = list(
            session.scalars(
                select(Batch.id).where(Batch.status == states.CANCELLING, Batch.in_progress_at.is_(None), stale)
            )
        )
    for batch_id in cancelling:
        _settle_cancel(jobs, batch_id)
    resumed = []
    for batch_id in validating:
        if claim(jobs, batch_id, stale_only=True):
            log.warning("resuming the validation of batch %s", batch_id)
            run_claimed(jobs, batch_id)
            resumed.append(batch_id)
    return resumed


def run_claimed(jobs: Jobs, batch_id: str) -> str:
    """Validate, and never let one batch's surprise kill the validator thread."""
    try:
        return validate_batch(jobs, batch_id)
    except (StorageError, OperationalError) as exc:  # transient: the lease runs out, a sweep retries
        log.warning("validation of batch %s interrupted, will retry: %s", batch_id, exc)
        return states.VALIDATING
    except Exception:  # an unexpected bug: the batch fails with a message rather than hanging
        log.exception("validation of batch %s crashed", batch_id)
        return _fail(jobs, batch_id, [LineError("validation_error", "the file could not be validated (internal error)")])


class ValidationRunner:
    """Validates batches on a background thread of the API process, counts the prompt tokens of
    started ones on another (so counting a big batch never holds up the next validation), and
    sweeps for work a dead process left behind."""

    def __init__(self, jobs: Jobs, sweep_seconds: float):
        self.jobs = jobs
        self.sweep_seconds = sweep_seconds
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchapi-validate")
        self._counting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchapi-count")
        self._counting_now: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="batchapi-validate-sweep", daemon=True)

    def start(self) -> None:
        self._sweeper.start()

    def submit(self, batch_id: str) -> None:
        """Validate ``batch_id``, whose lease was taken when it was created."""
        self._pool.submit(self._validate, batch_id)

    def _validate(self, batch_id: str) -> None:
        if run_claimed(self.jobs, batch_id) == states.IN_PROGRESS:
            self._count(batch_id)

    def _count(self, batch_id: str) -> None:
        with self._lock:
            if batch_id in self._counting_now:
                return
            self._counting_now.add(batch_id)
        self._counting.submit(self._count_now, batch_id)

    def _count_now(self, batch_id: str) -> None:
        try:
            count_batch(self.jobs, batch_id, stop=self._stop.is_set)
        except Exception:  # the sweep tries again; counts are an estimate, never a gate
            log.exception("counting the prompt tokens of batch %s failed", batch_id)
        finally:
            with self._lock:
                self._counting_now.discard(batch_id)

    def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._pool.submit(resume_stale, self.jobs).result()
                for batch_id in batches_to_count(self.jobs):
                    self._count(batch_id)
            except Exception:  # the database may be briefly away; the next sweep retries
                log.exception("validation sweep failed")
            self._stop.wait(self.sweep_seconds)

    def shutdown(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._counting.shutdown(wait=True, cancel_futures=True)

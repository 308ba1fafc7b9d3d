"""The sweeper: what no worker is there to do. One ``sweep`` for every process that sweeps.

- batches whose validator died are handed to a live one (``Validator``: only the API process
  validates, so only its sweep has one), and those cancelled while validating are settled;
  started batches whose prompts are not counted yet are counted (by the same ``Validator``);
- shards whose lease ran out (their worker died) go back to the queue, or, after
  ``max_shard_attempts`` lost leases (``leases.lost_leases``), are closed with every request in
  the error file as ``shard_failed``;
- batches being cancelled, or past ``expires_at``, get their unowned shards closed
  (``batch_cancelled`` / ``batch_expired``); shards a live worker holds are cut short by that
  worker within seconds; once nothing is open the batch is finalized, finished results kept;
- batches left with nothing open (a worker died between its last shard and the finalize),
  or stuck in ``finalizing``, are finalized;
- the plan (``fair_share.plan``) sets each running batch's estimated completion and marks those
  that cannot meet their window, which the claim order then serves first;
- files past ``expires_at`` lose their object and row (``files.remove_expired``), Uploads past
  their hour expire (``uploads.service.expire_uploads``), result cache entries whose output file
  is gone are deleted (``result_cache.remove_stale``), and due webhook deliveries are sent
  (``webhooks.delivery``), each POST bounded by ``webhook_timeout_seconds``.
Every step is a conditional UPDATE, so two sweepers (or a sweeper and a worker) never both act,
and every row is handled alone: one that raises is logged and skipped, never blocking the rest
(a shard whose input cannot be read back is still closed, its requests unnamed).
``batchapi beat`` runs the shard steps as a Celery periodic task; the API process runs a
``SweepLoop`` with its validator (and, in the embedded default, the shard steps too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from sqlalchemy import exists, select

from batchapi.background import Background
from batchapi.batches import files, leases, result_cache
from batchapi.batches.finalize import finalize_batch
from batchapi.batches.leases import CUT_OFF, Outcome
from batchapi.batches.shard_input import read_custom_ids
from batchapi.batches.sharing import fair_share
from batchapi.batches.states import OPEN_SHARDS, BatchStatus, ShardStatus
from batchapi.batches.uploads import expire_uploads
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch, Shard
from batchapi.errors import TRANSIENT, NotFound
from batchapi.openai import render
from batchapi.openai.errors import ErrorCode
from batchapi.storage import discard, remove_partial_writes
from batchapi.storage.keys import shard_error_key, shard_output_key, superseded_shard_keys
from batchapi.webhooks.delivery import deliver_due

log = logging.getLogger(__name__)

OWNER = "sweeper"
PARTIAL_WRITES_EVERY = 3600.0  # seconds between looks for partial writes (they are old after an hour)
T = TypeVar("T")


class Validator(Protocol):
    """What validates in this process (``validation.runner.ValidationRunner``)."""

    def resume(self, batch_id: str) -> None:
        """Take over the validation of ``batch_id``, whose validation lease ran out."""

    def backfill(self) -> None:
        """Count the prompt tokens of started batches not counted yet."""


@dataclass
class SweepReport:
    resumed: list[str] = field(default_factory=list)  # validations handed to the validator
    requeued: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    finalized: list[str] = field(default_factory=list)
    removed_files: list[str] = field(default_factory=list)  # expired (or deleted) files gone from storage
    expired_uploads: list[str] = field(default_factory=list)
    webhooks_delivered: int = 0
    at_risk: list[str] = field(default_factory=list)  # batches the plan found unable to meet their window


def sweep(ctx: Context, validator: Validator | None = None, *, shards: bool = True) -> SweepReport:
    """One pass over everything stale; ``shards`` False leaves the shard steps to another
    process (``batchapi beat`` in production). Each row is acted on alone (``_each``): one that
    raises is logged and skipped, and the rest of the sweep goes on."""
    report = SweepReport()
    steps = [_validations, _backfill] + ([_end_batches, _expired_leases, _finalize_leftovers, _plan, _expire_files,
                                          _deliver_webhooks] if shards else [])
    _each(steps, "the sweep step", lambda step: _timed(step, ctx, report, validator))
    if report.resumed or report.requeued or report.closed or report.finalized:
        log.info("sweep: %d validations resumed, %d requeued, %d closed, %d finalized", len(report.resumed),
                 len(report.requeued), len(report.closed), len(report.finalized))
    if report.removed_files or report.expired_uploads or report.webhooks_delivered:
        log.info("sweep: %d files removed, %d uploads expired, %d webhooks delivered", len(report.removed_files),
                 len(report.expired_uploads), report.webhooks_delivered)
    return report


SLOW_STEP_SECONDS = 5.0


def _timed(step, ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    start = time.monotonic()
    step(ctx, report, validator)
    if (took := time.monotonic() - start) > SLOW_STEP_SECONDS:
        log.warning("sweep step %s took %.1f s", step.__name__.lstrip("_"), took)


def _each(rows: Iterable[T], what: str, act: Callable[[T], object]) -> None:
    """``act`` on every row; a row that raises does not stop the others. A transient error is
    retried by the next sweep; anything else is a bug, logged with its row."""
    for row in rows:
        try:
            act(row)
        except TRANSIENT:
            log.warning("sweep: %s %s failed; the next sweep retries", what, _name(row), exc_info=True)
        except Exception:  # one bad row must not stop the sweep for everyone else
            log.exception("sweep: %s %s crashed; skipped", what, _name(row))


def _name(row: object) -> object:
    return getattr(row, "__name__", row)


def _validations(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    validating, cancelling = leases.stale_validations(ctx)
    _each(cancelling, "settling the cancelled validation of", lambda batch_id: leases.settle_cancelled_validation(
        ctx, batch_id))
    if validator is None:
        return

    def resume(batch_id: str) -> None:
        validator.resume(batch_id)
        report.resumed.append(batch_id)

    _each(validating, "resuming the validation of", resume)


def _backfill(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    if validator is not None:
        validator.backfill()


def _end_batches(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    t = now()
    with ctx.sessions() as session:
        ending = session.execute(
            select(Batch.id, Batch.status).where(
                ((Batch.status == BatchStatus.CANCELLING) & Batch.in_progress_at.is_not(None))
                | ((Batch.status == BatchStatus.IN_PROGRESS) & (Batch.expires_at <= t))
            )
        ).all()

    def end(row) -> None:
        batch_id, status = row
        reason = ErrorCode.BATCH_CANCELLED if status == BatchStatus.CANCELLING else ErrorCode.BATCH_EXPIRED
        with ctx.sessions() as session:
            unowned = list(session.scalars(
                select(Shard.id).where(
                    Shard.batch_id == batch_id,
                    (Shard.status == ShardStatus.QUEUED) | ((Shard.status == ShardStatus.RUNNING) & (Shard.lease_expires_at < t)),
                )
            ))
        _each(unowned, f"closing ({reason}) shard", lambda shard_id: _close(ctx, report, shard_id, reason))
        if finalize_batch(ctx, batch_id):
            report.finalized.append(batch_id)

    _each(ending, "ending batch", end)


def _plan(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    report.at_risk.extend(fair_share.plan(ctx).at_risk)


def _expired_leases(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    t = now()
    with ctx.sessions() as session:
        stale = session.execute(
            select(Shard.id, leases.lost_leases())
            .join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < t, Batch.status == BatchStatus.IN_PROGRESS)
        ).all()

    def recover(row) -> None:
        shard_id, lost = row
        if lost >= ctx.settings.max_shard_attempts:
            log.warning("shard %s lost its worker %d times; closing it", shard_id, lost)
            _close(ctx, report, shard_id, ErrorCode.SHARD_FAILED)
        elif leases.requeue_expired(ctx, shard_id):
            log.warning("shard %s lost its worker (%d times); re-queued", shard_id, lost)
            report.requeued.append(shard_id)

    _each(stale, "recovering the expired lease of shard", recover)


def _finalize_leftovers(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    t = now()
    any_open = exists().where(Shard.batch_id == Batch.id, Shard.status.in_(OPEN_SHARDS))
    with ctx.sessions() as session:
        done = list(session.scalars(select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS, ~any_open)))
        stuck = list(session.scalars(
            select(Batch.id).where(
                Batch.status == BatchStatus.FINALIZING, Batch.finalizing_at < t - ctx.settings.lease_seconds
            )
        ))

    def finalize(batch_id: str, resume: bool) -> None:
        if finalize_batch(ctx, batch_id, resume=resume):
            report.finalized.append(batch_id)

    _each(done, "finalizing batch", lambda batch_id: finalize(batch_id, False))
    _each(stuck, "finalizing the stuck batch", lambda batch_id: finalize(batch_id, True))


def _expire_files(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    report.removed_files.extend(files.remove_expired(ctx, _each))
    report.expired_uploads.extend(expire_uploads(ctx, _each))
    result_cache.remove_stale_when_due(ctx)  # entries whose output file (or batch) is gone


def _deliver_webhooks(ctx: Context, report: SweepReport, validator: Validator | None) -> None:
    report.webhooks_delivered += deliver_due(ctx.sessions, ctx.settings)


def _close(ctx: Context, report: SweepReport, shard_id: str, reason: ErrorCode) -> None:
    if close_shard(ctx, shard_id, reason):
        report.closed.append(shard_id)


def close_shard(ctx: Context, shard_id: str, reason: ErrorCode) -> bool:
    """Close a shard nobody runs: every request goes to its error object with ``reason``."""
    claimed = leases.claim_for_closing(ctx, shard_id, OWNER)
    if claimed is None:
        return False
    custom_ids = _custom_ids(ctx, claimed)
    # keys of their own: a stalled worker of the shard's last attempt may still write that attempt's
    out_key = shard_output_key(claimed.batch_id, claimed.index, claimed.attempts, closing=True)
    err_key = shard_error_key(claimed.batch_id, claimed.index, claimed.attempts, closing=True)
    ctx.storage.put_chunks(out_key, [b""])
    ctx.storage.put_chunks(err_key, (render.never_ran(cid, reason) for cid in custom_ids))
    unrun = len(custom_ids) if reason in CUT_OFF else 0
    # a closer that loses its lease keeps its objects: the next closer of the attempt writes the same keys
    if not leases.complete(ctx, claimed, OWNER, Outcome(0, len(custom_ids), reason=reason, unrun=unrun), out_key,
                           err_key):
        return False
    discard(ctx.storage, superseded_shard_keys(claimed.batch_id, claimed.index, claimed.attempts, closing=True))
    return True


def _custom_ids(ctx: Context, claimed: leases.Claimed) -> list[str | None]:
    """The ids to name in the closed shard's error lines. Closing must always end: input that
    cannot be read back as validation saw it still gives one error line per request, unnamed."""
    try:
        return read_custom_ids(ctx.storage, claimed, ctx.settings.max_line_bytes)
    except NotFound:  # the input object is gone: nothing left to name in the error file
        log.error("the input of shard %s is gone from storage; closing it empty", claimed.id)
        return []
    except TRANSIENT:
        raise
    except Exception:  # a retry would meet it again, and the shard would never close
        log.exception("the input of shard %s cannot be read back; closing its %d requests unnamed", claimed.id,
                      claimed.request_count)
        return [None] * claimed.request_count


class SweepLoop:
    """``sweep`` on a thread of its own: at start, every ``interval`` seconds, and soon after
    ``poke`` (a cancel: its queued shards are closed now rather than at the next tick). At start
    and then hourly it also removes what writers killed mid-write left in storage."""

    def __init__(self, ctx: Context, interval: float, validator: Validator | None = None, *, shards: bool = True):
        self.ctx = ctx
        self.interval = interval
        self.validator = validator
        self.shards = shards
        self._poked = threading.Event()
        self._thread = Background("batchapi-sweep", self._run, wake=self._poked.set)

    def start(self) -> SweepLoop:
        self._thread.start()
        return self

    def poke(self) -> None:
        self._poked.set()

    def stop(self) -> None:
        self._thread.stop(timeout=30)

    def _run(self) -> None:
        cleaned = None  # when partial writes were last looked for (monotonic seconds)
        while not self._thread.stopping.is_set():
            try:
                sweep(self.ctx, self.validator, shards=self.shards)
            except TRANSIENT:
                log.warning("sweep failed; the next one retries", exc_info=True)
            except Exception:  # a bug in one sweep must not end every later one
                log.exception("sweep crashed; the next one retries")
            if cleaned is None or time.monotonic() - cleaned >= PARTIAL_WRITES_EVERY:
                cleaned = time.monotonic()
                remove_partial_writes(self.ctx.storage)
            self._poked.wait(self.interval)
            self._poked.clear()

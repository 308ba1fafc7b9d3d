"""The sweeper: what no worker is there to do.

- shards whose lease ran out (their worker died) go back to the queue, or, after
  ``max_shard_attempts``, are closed with every request in the error file as ``shard_failed``;
- batches being cancelled, or past ``expires_at``, get their unowned shards closed
  (``batch_cancelled`` / ``batch_expired``); shards a live worker holds are cut short by that
  worker within seconds; once nothing is open the batch is finalized, finished results kept;
- batches left with nothing open (a worker died between its last shard and the finalize),
  or stuck in ``finalizing``, are finalized.
Every step is a conditional UPDATE, so two sweepers (or a sweeper and a worker) never both act.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import exists, select

from batchapi.jobs import states
from batchapi.jobs.context import Jobs
from batchapi.jobs.errors import NotFound
from batchapi.jobs.ids import now
from batchapi.jobs.models import Batch, Shard
from batchapi.jobs.storage import shard_error_key, shard_output_key
from batchapi.workers import leases, result_lines
from batchapi.workers.finalize import finalize_batch
from batchapi.workers.leases import OPEN, QUEUED, RUNNING, Outcome
from batchapi.workers.shard_input import read_custom_ids

log = logging.getLogger(__name__)

OWNER = "sweeper"


@dataclass
class SweepReport:
    requeued: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    finalized: list[str] = field(default_factory=list)


def sweep(jobs: Jobs) -> SweepReport:
    report = SweepReport()
    _end_batches(jobs, report)
    _expired_leases(jobs, report)
    _finalize_leftovers(jobs, report)
    if report.requeued or report.closed or report.finalized:
        log.info("sweep: %d requeued, %d closed, %d finalized",
                 len(report.requeued), len(report.closed), len(report.finalized))
    return report


def _end_batches(jobs: Jobs, report: SweepReport) -> None:
    t = now()
    with jobs.sessions() as session:
        ending = session.execute(
            select(Batch.id, Batch.status).where(
                ((Batch.status == states.CANCELLING) & Batch.in_progress_at.is_not(None))
                | ((Batch.status == states.IN_PROGRESS) & (Batch.expires_at <= t))
            )
        ).all()
    for batch_id, status in ending:
        reason = "batch_cancelled" if status == states.CANCELLING else "batch_expired"
        with jobs.sessions() as session:
            unowned = list(session.scalars(
                select(Shard.id).where(
                    Shard.batch_id == batch_id,
                    (Shard.status == QUEUED) | ((Shard.status == RUNNING) & (Shard.lease_expires_at < t)),
                )
            ))
        for shard_id in unowned:
            if close_shard(jobs, shard_id, reason):
                report.closed.append(shard_id)
        if finalize_batch(jobs, batch_id):
            report.finalized.append(batch_id)


def _expired_leases(jobs: Jobs, report: SweepReport) -> None:
    t = now()
    with jobs.sessions() as session:
        stale = session.execute(
            select(Shard.id, Shard.attempts)
            .join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.status == RUNNING, Shard.lease_expires_at < t, Batch.status == states.IN_PROGRESS)
        ).all()
    for shard_id, attempts in stale:
        if attempts >= jobs.settings.max_shard_attempts:
            log.warning("shard %s failed %d times; closing it", shard_id, attempts)
            if close_shard(jobs, shard_id, "shard_failed"):
                report.closed.append(shard_id)
        elif leases.requeue_expired(jobs, shard_id):
            log.warning("shard %s lost its worker (attempt %d); re-queued", shard_id, attempts)
            report.requeued.append(shard_id)


def _finalize_leftovers(jobs: Jobs, report: SweepReport) -> None:
    t = now()
    any_open = exists().where(Shard.batch_id == Batch.id, Shard.status.in_(OPEN))
    with jobs.sessions() as session:
        done = list(session.scalars(select(Batch.id).where(Batch.status == states.IN_PROGRESS, ~any_open)))
        stuck = list(session.scalars(
            select(Batch.id).where(
                Batch.status == states.FINALIZING, Batch.finalizing_at < t - jobs.settings.lease_seconds
            )
        ))
    for batch_id in done:
        if finalize_batch(jobs, batch_id):
            report.finalized.append(batch_id)
    for batch_id in stuck:
        if finalize_batch(jobs, batch_id, resume=True):
            report.finalized.append(batch_id)


def close_shard(jobs: Jobs, shard_id: str, reason: str) -> bool:
    """Close a shard nobody runs: every request goes to its error object with ``reason``."""
    claimed = leases.claim_for_closing(jobs, shard_id, OWNER)
    if claimed is None:
        return False
    try:
        custom_ids = read_custom_ids(jobs.storage, claimed)
    except NotFound:  # the input object is gone: nothing left to name in the error file
        log.error("the input of shard %s is gone from storage; closing it empty", shard_id)
        custom_ids = []
    out_key = shard_output_key(claimed.batch_id, claimed.index)
    err_key = shard_error_key(claimed.batch_id, claimed.index)
    jobs.storage.put_chunks(out_key, [b""])
    jobs.storage.put_chunks(err_key, (result_lines.never_ran(cid, reason) for cid in custom_ids))
    return leases.complete(jobs, claimed, OWNER, Outcome(0, len(custom_ids), reason=reason), out_key, err_key)

"""The sweep as a Celery periodic task: what ``batchapi beat`` schedules and runs.

Every ``sweep_seconds`` the beat scheduler sends a ``sweep`` message to the sweep queue
(``settings.sweep_queue``), never the shard queue, so a sweep never waits behind a long shard;
the solo worker of the same ``batchapi beat`` process runs it. The task takes no arguments:
each run re-reads the database, and the sweeper's conditional UPDATEs make a late, duplicated
or overlapping sweep harmless. A sweep message older than one interval is dropped unrun, since
the next one is already on its way.
"""

from __future__ import annotations

import logging

from celery import Celery
from celery.beat import EmbeddedService
from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy.exc import OperationalError

from batchapi.batches.leases import models_of
from batchapi.batches.sweeper import sweep
from batchapi.config import Settings
from batchapi.context import Context
from batchapi.errors import StorageError
from batchapi.workers.celery_app import SWEEP, send_shards, shard_queue

log = logging.getLogger(__name__)

# an interval needs no memory across restarts, so no schedule file to keep writable
IN_MEMORY_SCHEDULER = "celery.beat:Scheduler"


def register(app: Celery, ctx: Context) -> None:
    settings = ctx.settings

    @app.task(name=SWEEP)
    def sweep_task() -> None:
        try:
            report = sweep(ctx)
            for model, shard_ids in models_of(ctx, report.requeued).items():
                send_shards(app, shard_queue(settings, model), shard_ids)
        except (OperationalError, BrokerError, StorageError, OSError):
            log.warning("sweep failed; the next one retries", exc_info=True)


def schedule(app: Celery, settings: Settings) -> None:
    app.conf.beat_schedule = {
        "sweep": {
            "task": SWEEP,
            "schedule": settings.sweep_seconds,
            "options": {"queue": settings.sweep_queue, "expires": settings.sweep_seconds},
        },
    }


def start_scheduler(app: Celery) -> EmbeddedService:
    """The beat scheduler in a thread of this process (not ``worker --beat``'s forked child),
    so one process is the whole of ``batchapi beat`` and whatever ends it ends both."""
    scheduler = EmbeddedService(app, thread=True, scheduler_cls=IN_MEMORY_SCHEDULER)
    scheduler.start()
    return scheduler

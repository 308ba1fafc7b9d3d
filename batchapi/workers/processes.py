"""The long-running processes of a production deployment: ``batchapi worker`` and ``batchapi beat``."""

from __future__ import annotations

import logging
import os
import threading

from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy.exc import OperationalError

from batchapi.config import Settings
from batchapi.jobs.context import open_jobs
from batchapi.jobs.errors import StorageError
from batchapi.workers.celery_app import make_celery, send_shards
from batchapi.workers.sweeper import sweep

log = logging.getLogger(__name__)


def run_worker(settings: Settings, name: str | None = None) -> None:
    """One Celery worker per GPU: the engine is loaded here, once, before consuming. The solo
    pool runs one task at a time in this process; the runner's feeder keeps more shards in
    the engine, and a message whose shard it already took finds nothing to do."""
    from batchapi.workers import tasks  # the engine's imports: only a worker process pays for them
    from batchapi.workers.engine_setup import start_runner

    jobs = open_jobs(settings)
    runner = start_runner(jobs)
    tasks.install(runner)
    app = make_celery(settings)
    tasks.register(app)
    try:
        app.worker_main([
            "worker", "--pool=solo", "--concurrency=1", "-Q", settings.celery_queue,
            "-n", name or f"batchapi-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
            "--loglevel=INFO",
        ])
    finally:
        tasks.install(None)
        runner.shutdown()
        jobs.close()


def run_beat(settings: Settings, stop: threading.Event | None = None) -> None:
    """The sweeper: every ``sweep_seconds``, sweep and send tasks for re-queued shards."""
    stop = stop or threading.Event()
    jobs = open_jobs(settings)
    app = make_celery(settings)
    try:
        while True:
            try:
                report = sweep(jobs)
                send_shards(app, settings.celery_queue, report.requeued)
            except (OperationalError, BrokerError, StorageError, OSError):
                log.warning("sweep failed; the next one retries", exc_info=True)
            if stop.wait(settings.sweep_seconds):
                return
    finally:
        jobs.close()

"""The long-running processes of a production deployment: ``batchapi worker`` and ``batchapi beat``."""

from __future__ import annotations

import logging
import os

from batchapi import metrics
from batchapi.config import Settings
from batchapi.context import open_context
from batchapi.workers import beat
from batchapi.workers.celery_app import make_celery, worker_queues

log = logging.getLogger(__name__)


def _quiet(settings: Settings) -> list[str]:
    """JSON logs are JSON lines only: no Celery start-up banner printed around them."""
    return ["--quiet"] if settings.log_format == "json" else []


def run_worker(settings: Settings, name: str | None = None) -> None:
    """One Celery worker per GPU: the engine is loaded here, once, before consuming. The solo
    pool runs one task at a time in this process; the runner's feeder keeps more shards in
    the engine, and a message whose shard it already took finds nothing to do. Should the
    engine thread die, the worker gives its shards back, shuts down and exits with status 1,
    so that its supervisor restarts it."""
    from batchapi.workers import tasks  # the engine's imports: only a worker process pays for them
    from batchapi.workers.engine_setup import start_runner

    ctx = open_context(settings)
    runner = start_runner(ctx)
    metrics.attach_runner(runner)
    if settings.metrics_port:  # the engine's gauges; the job tables' numbers are on the API's /metrics
        metrics.serve_engine_metrics(settings.metrics_port)
    tasks.install(runner)
    app = make_celery(settings)
    tasks.register(app)
    try:
        app.worker_main([
            *_quiet(settings), "worker", "--pool=solo", "--concurrency=1", "-Q", ",".join(worker_queues(settings)),
            "-n", name or f"batchapi-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
            "--loglevel=INFO",
        ])
    finally:
        tasks.install(None)
        runner.shutdown()
        ctx.close()
    if runner.engine_dead.is_set():
        raise SystemExit("batchapi worker: the engine thread died; exiting so that the supervisor restarts it")


def run_beat(settings: Settings) -> None:
    """The sweeper as Celery beat: the scheduler sends a ``sweep`` task every ``sweep_seconds``
    to the sweep queue, and this process's solo worker, consuming only that queue, runs it."""
    ctx = open_context(settings)
    app = make_celery(settings)
    beat.register(app, ctx)
    beat.schedule(app, settings)
    # a sweep's own log says what it did; Celery's lines for each send, receipt and success
    # would repeat every few seconds
    for name in ("celery.beat", "celery.worker.strategy", "celery.app.trace"):
        logging.getLogger(name).setLevel(logging.WARNING)
    scheduler = beat.start_scheduler(app)
    try:
        app.worker_main([
            *_quiet(settings), "worker", "--pool=solo", "--concurrency=1", "-Q", settings.sweep_queue,
            "-n", f"batchapi-beat-{os.getpid()}@%h", "--without-gossip", "--without-mingle",
            "--loglevel=INFO",
        ])
    finally:
        scheduler.stop()
        ctx.close()

"""The long-running worker processes: ``batchapi worker`` and ``batchapi beat`` of a production
deployment, and the embedded default's worker, the child process of ``batchapi serve``
(``run_embedded_worker``; ``workers.embedded.WorkerProcess`` starts and supervises it).

A worker with an identity (the embedded one always; a Celery worker started with ``--slot``)
takes back, as it starts, the shards an earlier process of that identity still held when it died,
rather than leaving them to wait out their leases (``leases.take_back``)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

from batchapi import metrics
from batchapi.config import Settings
from batchapi.context import open_context
from batchapi.openai.errors import ErrorCode
from batchapi.workers import beat
from batchapi.workers.celery_app import make_celery, worker_queues

log = logging.getLogger(__name__)


def _quiet(settings: Settings) -> list[str]:
    """JSON logs are JSON lines only: no Celery start-up banner printed around them."""
    return ["--quiet"] if settings.log_format == "json" else []


EMBEDDED_IDENTITY = "embedded"


def worker_identity(slot: str) -> str:
    """The identity of the worker in ``slot`` on this host (``HOST:SLOT``)."""
    assert "/" not in slot, f"a worker slot has no '/': {slot!r}"
    return f"{socket.gethostname()}:{slot}"


def _start(ctx, identity: str | None):
    """The runner (engine loaded, threads started), with the shards of its identity's earlier
    process taken back."""
    from batchapi.batches import leases
    from batchapi.workers.engine_setup import start_runner

    runner = start_runner(ctx, identity)
    if identity is not None:
        try:
            requeued, ended = leases.take_back(ctx, identity, runner.owner)
        except BaseException:
            runner.shutdown()  # its engine core would keep this process from exiting
            raise
        if requeued or ended:
            log.info("took back %d shards of an earlier %s worker (%d of them out of attempts, left to the "
                     "sweeper)", requeued + ended, identity, ended)
        runner.wake()
    metrics.attach_runner(runner)
    return runner


def run_worker(settings: Settings, name: str | None = None, slot: str | None = None) -> None:
    """One Celery worker per GPU: the engine is loaded here, once, before consuming. The solo
    pool runs one task at a time in this process; the runner's feeder keeps more shards in
    the engine, and a message whose shard it already took finds nothing to do. Should the
    engine thread die, the worker gives its shards back, shuts down and exits with status 1,
    so that its supervisor restarts it. ``slot`` (e.g. its GPU's index): the worker is
    ``HOST:SLOT``, and a restart in that slot takes its shards back at once."""
    from batchapi.workers import tasks  # the engine's imports: only a worker process pays for them

    identity = worker_identity(slot) if slot is not None else None
    ctx = open_context(settings)
    runner = _start(ctx, identity)
    if settings.metrics_port:  # the engine's gauges; the job tables' numbers are on the API's /metrics
        metrics.serve_engine_metrics(settings.metrics_port)
    tasks.install(runner)
    app = make_celery(settings)
    tasks.register(app)
    try:
        app.worker_main([
            *_quiet(settings), "worker", "--pool=solo", "--concurrency=1", "-Q", ",".join(worker_queues(settings)),
            "-n", name or f"batchapi-{slot if slot is not None else os.getpid()}@%h", "--without-gossip", "--without-mingle",
            "--loglevel=INFO",
        ])
    finally:
        tasks.install(None)
        runner.shutdown()
        ctx.close()
    if runner.engine_dead.is_set():
        raise SystemExit("batchapi worker: the engine thread died; exiting so that the supervisor restarts it")


def run_embedded_worker(settings: Settings) -> None:
    """``batchapi serve``'s worker, its child process: the same runner as ``batchapi worker``'s,
    without a broker. Its parent writes a line to its stdin for each event (``wake``: new shards are
    queued; ``cancel BATCH_ID``: abort that batch's requests now); the end of stdin (the parent
    stopped or died) or SIGTERM stops it, after it gave its shards back. Ctrl-C is its parent's to
    handle. Exits with status 1 when its engine died, so that its parent starts a fresh one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    runner = None
    ready = threading.Event()

    def read_events() -> None:
        for line in sys.stdin:
            ready.wait()
            event, _, batch_id = line.strip().partition(" ")
            if event == "wake":
                runner.wake()
            elif event == "cancel" and batch_id:
                runner.abort_batch(batch_id, ErrorCode.BATCH_CANCELLED)
        stop.set()  # the parent is gone

    threading.Thread(target=read_events, name="batchapi-events", daemon=True).start()
    ctx = open_context(settings)
    try:
        runner = _start(ctx, worker_identity(EMBEDDED_IDENTITY))
        ready.set()
        if settings.embedded_metrics_port:  # serve's /metrics adds these (``WorkerProcess``)
            metrics.serve_engine_metrics(settings.embedded_metrics_port, host="127.0.0.1")
        while not stop.wait(1.0):  # a timeout, so that the SIGTERM handler runs promptly
            pass
    finally:
        if runner is not None:
            runner.shutdown()
        ctx.close()
    if runner.engine_dead.is_set():
        raise SystemExit("batchapi serve's worker: the engine thread died; exiting so that serve restarts it")


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

"""``batchapi beat`` is Celery beat: its schedule sends the sweep to a queue of its own and the
same process runs it, against a private redis-server and PostgreSQL, with no GPU worker at all."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import pytest
import redis
from sqlalchemy import update

from batchapi.batches import leases
from batchapi.config import load_settings
from batchapi.context import open_context
from batchapi.db.clock import now
from batchapi.db.migrate import upgrade
from batchapi.db.models import Shard
from batchapi.db.session import session_scope
from batchapi.workers.celery_app import RUN_SHARD
from tests.utils import services
from tests.utils.job_rows import make_batch, shard
from tests.utils.waiting import wait_until
from tests.workers import processes
from tests.workers.processes import RedisServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("beat")
    broker = RedisServer(workdir)
    broker.start()
    try:
        with services.fresh_database("batchapi_beat") as pg_url:
            settings = load_settings(
                data_dir=workdir, database_url=pg_url, broker_url=broker.url, lease_seconds=5,
                heartbeat_seconds=1.0, sweep_seconds=0.5, celery_queue=f"gpu-test-{uuid.uuid4().hex[:8]}",
            )
            upgrade(settings)
            ctx = open_context(settings)
            log = workdir / "beat.log"
            beat = processes.spawn(["beat"], processes.env_of(settings), log)
            try:
                processes.wait_ready(beat, log, "batchapi beat")
                yield ctx, broker, beat
            finally:
                processes.stop(beat)
                ctx.close()
            assert beat.returncode == 0, f"batchapi beat did not stop cleanly: {log.read_text(errors='replace')}"
    finally:
        broker.stop()


def queued_tasks(broker: RedisServer, queue: str) -> list[tuple[str, list]]:
    """The (task name, args) of every message waiting in a queue, oldest first."""
    client = redis.Redis.from_url(broker.url)
    try:
        raw = client.lrange(queue, 0, -1)
    finally:
        client.close()
    tasks = []
    for message in reversed(raw):  # kombu LPUSHes and its consumers pop from the right
        envelope = json.loads(message)
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        tasks.append((envelope["headers"]["task"], args))
    return tasks


def test_the_beat_requeues_a_shard_whose_worker_died(deployment):
    ctx, broker, _ = deployment
    _, (sid,) = make_batch(ctx, 1)
    assert leases.claim(ctx, sid, "dead-worker") is not None
    with session_scope(ctx.sessions) as session:  # the worker died: its lease ran out
        session.execute(update(Shard).where(Shard.id == sid).values(lease_expires_at=now() - 1))

    # a scheduled sweep re-queues the shard and sends its task to the (unconsumed) shard queue
    wait_until(lambda: queued_tasks(broker, ctx.settings.celery_queue), timeout=30, interval=0.2)
    assert queued_tasks(broker, ctx.settings.celery_queue) == [(RUN_SHARD, [sid])]
    requeued = shard(ctx, sid)
    assert (requeued.status, requeued.attempts, requeued.lease_owner) == ("queued", 1, None)


def test_the_beat_loads_no_torch(deployment):
    _, _, beat = deployment
    assert beat.poll() is None
    assert "torch" not in Path(f"/proc/{beat.pid}/maps").read_text()

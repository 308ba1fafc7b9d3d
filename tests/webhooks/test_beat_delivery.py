"""In production the sweep is a Celery task that ``batchapi beat`` runs: the webhook of a batch
that ends is delivered by it (a private redis-server as the broker, PostgreSQL, a real receiver,
no API process and no GPU worker), retried after the receiver fails."""

from __future__ import annotations

import uuid

import openai
import pytest

from batchapi.batches import states
from batchapi.batches.states import BatchStatus
from batchapi.config import load_settings
from batchapi.context import open_context
from batchapi.db.migrate import upgrade
from batchapi.db.models import Batch, WebhookDelivery
from batchapi.db.session import session_scope
from batchapi.webhooks import endpoints
from tests.utils import services
from tests.utils.job_rows import make_batch
from tests.utils.waiting import wait_until
from tests.webhooks.receiver import Receiver
from tests.workers import processes
from tests.workers.processes import RedisServer

pytestmark = pytest.mark.slow


def test_batchapi_beat_delivers_and_retries(tmp_path):
    broker = RedisServer(tmp_path)
    broker.start()
    try:
        with services.fresh_database("batchapi_beat_hooks") as pg_url, Receiver(statuses=[500]) as receiver:
            settings = load_settings(data_dir=tmp_path, database_url=pg_url, broker_url=broker.url, sweep_seconds=0.5,
                                     webhook_retry_seconds=1, webhook_allow_private=True,  # a 127.0.0.1 receiver
                                     celery_queue=f"gpu-test-{uuid.uuid4().hex[:8]}")
            upgrade(settings)
            ctx = open_context(settings)
            log = tmp_path / "beat.log"
            beat = processes.spawn(["beat"], processes.env_of(settings), log)
            try:
                processes.wait_ready(beat, log, "batchapi beat")
                batch_id, _ = make_batch(ctx, 0)
                with session_scope(ctx.sessions) as session:
                    project_id = session.get(Batch, batch_id).project_id
                    secret = endpoints.create_endpoint(session, settings, project_id, receiver.url).secret
                with session_scope(ctx.sessions) as session:
                    assert states.transition(session, batch_id, BatchStatus.EXPIRED)
                wait_until(lambda: len(receiver.received) == 2, timeout=60, interval=0.2)
                with ctx.sessions() as session:
                    delivery = session.query(WebhookDelivery).filter_by(batch_id=batch_id).one()
                    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 2, 200)
            finally:
                processes.stop(beat)
                ctx.close()
            assert beat.returncode == 0, log.read_text(errors="replace")
    finally:
        broker.stop()
    sdk = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
    assert [r.status for r in receiver.received] == [500, 200]
    for got in receiver.received:
        assert sdk.webhooks.unwrap(got.body, got.headers, secret=secret).data.id == batch_id

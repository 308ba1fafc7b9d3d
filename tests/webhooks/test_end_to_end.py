"""The whole path on the embedded stack (live server, embedded worker and its sweep loop, on
PostgreSQL and SeaweedFS): batches run through the openai SDK end, and their signed events reach a
real receiver, verified by the SDK's ``unwrap``; the output file carries ``output_expires_after``."""

from __future__ import annotations

import io

import openai
import pytest

from batchapi.db.models import Project
from batchapi.db.session import session_scope
from batchapi.webhooks import endpoints
from tests.utils.batch_service import embedded_stack, jsonl, new_key, request_line, run_to_end
from tests.utils.waiting import wait_for_batch, wait_until
from tests.webhooks.receiver import Receiver

pytestmark = pytest.mark.slow


def test_finished_and_cancelled_batches_send_their_events(tmp_path, tiny_llama_dir, s3):
    with embedded_stack(tmp_path, tiny_llama_dir, "webhooks", s3=s3) as server, Receiver() as receiver:
        key = new_key(server, "nightly")
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
        with session_scope(server.ctx.sessions) as session:
            project = session.query(Project).filter_by(name="nightly").one()
            endpoint = endpoints.create_endpoint(session, server.ctx.settings, project.id, receiver.url)
            secret = endpoint.secret
        model_id = server.app.state.model.id

        lines = [request_line(f"r{i}", model_id, max_tokens=4) for i in range(3)]
        uploaded = client.files.create(file=("b.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", output_expires_after={"anchor": "created_at",
                                                                                     "seconds": 7200})
        batch = wait_for_batch(client, batch.id, timeout=300, interval=0.3)
        assert batch.status == "completed", batch.errors
        output = client.files.retrieve(batch.output_file_id)
        assert output.expires_at == output.created_at + 7200
        wait_until(lambda: receiver.received, timeout=30)
        [got] = receiver.received
        event = client.webhooks.unwrap(got.body, got.headers, secret=secret)
        assert (event.type, event.data.id) == ("batch.completed", batch.id)

        plain, _, _ = run_to_end(client, lines[:1], "/v1/chat/completions")  # no output_expires_after
        assert client.files.retrieve(plain.output_file_id).expires_at is None

        cancelled = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
        client.batches.cancel(cancelled.id)
        wait_for_batch(client, cancelled.id, {"cancelled"}, timeout=60, interval=0.3)
        wait_until(lambda: len(receiver.received) == 3, timeout=30)
        events = [client.webhooks.unwrap(r.body, r.headers, secret=secret) for r in receiver.received]
        assert sorted((e.data.id, e.type) for e in events) == sorted([  # sent in parallel: in any order
            (batch.id, "batch.completed"), (plain.id, "batch.completed"), (cancelled.id, "batch.cancelled")])

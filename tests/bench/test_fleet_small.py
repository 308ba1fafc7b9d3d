"""A test-sized run of ``bench/fleet.py``: a few simulated workers (the production claim, lease,
heartbeat, result-writing and finalisation code around a stand-in engine) on PostgreSQL and
SeaweedFS end a batch of a few hundred requests with every custom_id in its output exactly once."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from sqlalchemy import select

from batchapi.context import open_context
from batchapi.db.models import Shard
from tests.utils.batch_service import jsonl
from tests.utils.waiting import wait_for_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fleet  # noqa: E402

REQUESTS = 300


def test_a_small_fleet_ends_every_request_exactly_once(pg_server, client, model_id):
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model_id, "prompt": [100 + i % 50, 200, 300], "max_tokens": 2 + i % 5,
                       "temperature": 1.0}}
             for i in range(REQUESTS)]
    uploaded = client.files.create(file=("fleet.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    # the server has no worker: the fleet finds the shards by polling, as workers do between broker messages
    ctx = open_context(pg_server.ctx.settings.model_copy(update={"worker_poll_seconds": 0.2}))
    try:
        with fleet.Fleet(ctx, workers=4, tokens_per_second=2000, model=model_id, name="test-fleet"):
            batch = wait_for_batch(client, batch.id, timeout=60, interval=0.2)
        with ctx.sessions() as session:
            owners = set(session.scalars(select(Shard.lease_owner).where(Shard.batch_id == batch.id)))
    finally:
        ctx.close()

    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (REQUESTS, REQUESTS)
    assert batch.error_file_id is None
    output = [json.loads(raw) for raw in client.files.content(batch.output_file_id).text.splitlines()]
    custom_ids = [record["custom_id"] for record in output]
    assert sorted(custom_ids) == sorted(line["custom_id"] for line in lines)  # each exactly once
    for record in output:
        i = int(record["custom_id"].removeprefix("req-"))
        assert record["response"]["body"]["usage"]["completion_tokens"] == 2 + i % 5
    assert len(owners) > 1, owners  # the shards were shared out among the workers

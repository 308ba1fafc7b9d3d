"""Metrics with Celery workers: the API's ``/metrics`` (read from the job tables) equals the
batches' usage, and each ``batchapi worker`` serves its engine's gauges on BATCHAPI_METRICS_PORT."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.utils import services
from tests.utils.scrape import scrape, usage_counters
from tests.utils.waiting import wait_for_batch
from tests.workers.helpers import lines_for, submit

pytestmark = pytest.mark.slow


def test_counters_equal_the_batches_usage_with_celery_workers(cluster):
    port = services.free_port()
    cluster.env.update(BATCHAPI_METRICS_PORT=str(port), BATCHAPI_LOG_FORMAT="json")
    try:
        name = cluster.start_worker()
    finally:
        del cluster.env["BATCHAPI_METRICS_PORT"], cluster.env["BATCHAPI_LOG_FORMAT"]
    cluster.wait_ready(name)
    model = cluster.server.app.state.model.id
    with cluster.http() as http:
        ids = [submit(http, lines_for(model, n, prefix=f"m{n}", max_tokens=5)) for n in (12, 7)]
        batches = [wait_for_batch(http, batch_id, timeout=180) for batch_id in ids]
    assert [b["status"] for b in batches] == ["completed", "completed"]

    api = scrape(cluster.base_url)
    assert usage_counters(api, model) == {
        "input_tokens": sum(b["usage"]["input_tokens"] for b in batches),
        "cached_input_tokens": sum(b["usage"]["input_tokens_details"]["cached_tokens"] for b in batches),
        "output_tokens": sum(b["usage"]["output_tokens"] for b in batches),
        "model_requests": 19,
    }
    assert api[("batchapi_requests_finished_total", (("outcome", "succeeded"),))] == 19
    assert api[("batchapi_batches", (("status", "completed"),))] == 2
    assert not any(name.startswith("batchapi_engine_") for name, _ in api)  # no engine in the API process

    worker = scrape(f"http://127.0.0.1:{port}")
    labels = (("model", model),)
    assert worker[("batchapi_engine_generation_tokens_total", labels)] == sum(
        b["usage"]["output_tokens"] for b in batches)
    assert worker[("batchapi_engine_step_seconds_count", labels)] > 0
    assert (("batchapi_engine_running_sequences", labels)) in worker
    assert 0 <= worker[("batchapi_engine_kv_cache_usage_ratio", labels)] <= 1
    assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200

    # the worker's log is JSON lines only, with the shard and batch ids its runner names
    lines = [json.loads(line) for line in cluster.worker_log(name).splitlines() if line.strip()]
    done = [line for line in lines if line["message"].startswith("shard ") and " done: " in line["message"]]
    assert {line["batch_id"] for line in done} == set(ids)
    assert all(line["shard_id"].startswith(line["batch_id"] + "_") for line in done)

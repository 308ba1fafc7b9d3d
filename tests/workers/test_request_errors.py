"""Per-request errors end to end: a request whose body is refused is a 400 in the error file and
the rest of the batch runs (the embedded worker on PostgreSQL, the tiny model)."""

from __future__ import annotations

from decimal import Decimal

import httpx
import pytest

from batchapi.db.migrate import upgrade
from batchapi.workers.embedded import EmbeddedWorker
from tests.utils import services
from tests.utils.batch_service import live_server, service_settings
from tests.utils.waiting import PAST_VALIDATION, read_batch, wait_for_batch
from tests.workers.helpers import assert_each_once, lines_for, results, submit

SETTINGS = dict(
    shard_size=4, sweep_seconds=0.5, worker_poll_seconds=0.5, max_num_seqs=8, max_num_batched_tokens=256,
    kv_cache_gb=0.05, device="cpu", auth_required=False, lease_seconds=10, heartbeat_seconds=1.0,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    with services.fresh_database("batchapi_request_errors") as pg_url:
        settings = service_settings(tmp_path_factory.mktemp("request-errors"), tiny_llama_dir, pg_url=pg_url,
                                    **SETTINGS)
        upgrade(settings)
        worker = EmbeddedWorker()
        with live_server(settings, dispatcher=worker, hook=worker.run, sweep_shards=True) as server:
            yield server


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture
def model(server) -> str:
    return server.app.state.model.id


def refusal(line: dict) -> tuple:
    error = line["response"]["body"]["error"]
    return line["custom_id"], line["response"]["status_code"], error["code"], error["param"], line["error"]


def test_a_refused_body_is_a_400_and_the_rest_of_the_batch_runs(http, model):
    lines = lines_for(model, 10, prefix="mixed", max_tokens=2)
    lines[3]["body"]["frobnicate"] = 1
    batch_id = submit(http, lines)
    early = wait_for_batch(http, batch_id, PAST_VALIDATION, timeout=60)
    assert early["errors"] is None and early["request_counts"]["total"] == 10
    assert early["request_errors"] == {"object": "list", "total": 1, "data": [{
        "code": "unknown_parameter", "message": "unrecognized request argument: 'frobnicate'",
        "param": "body.frobnicate", "line": 4}]}

    batch = wait_for_batch(http, batch_id)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 10, "completed": 9, "failed": 1}
    assert batch["request_errors"] == early["request_errors"]
    output, errors = results(http, batch)
    assert_each_once(lines, output, errors)
    assert [refusal(e) for e in errors] == [("mixed-3", 400, "unknown_parameter", "frobnicate", None)]
    assert errors[0]["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert sorted(r["custom_id"] for r in output) == sorted(f"mixed-{i}" for i in range(10) if i != 3)
    assert all(r["response"]["status_code"] == 200 for r in output)
    assert batch["usage"]["input_tokens"] == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in output)


def test_a_batch_whose_every_body_is_refused_runs_and_every_request_is_a_400(http, model):
    lines = lines_for(model, 6, prefix="allbad", top_p=1.5)
    batch = wait_for_batch(http, submit(http, lines))
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 6, "completed": 0, "failed": 6}
    assert batch["request_errors"]["total"] == 6
    assert [e["line"] for e in batch["request_errors"]["data"]] == [1, 2, 3, 4, 5, 6]
    output, errors = results(http, batch)
    assert output == [] and batch["output_file_id"] is None
    assert [refusal(e) for e in errors] == [(f"allbad-{i}", 400, "invalid_value", "top_p", None) for i in range(6)]
    assert batch["usage"]["input_tokens"] == 0 and Decimal(batch["cost"]["amount"]) == 0


def test_a_file_problem_still_fails_the_batch_with_its_line(http, model):
    lines = lines_for(model, 3, prefix="badfile")
    lines[0]["body"]["frobnicate"] = 1
    batch_id = submit(http, [lines[0], "{oops", lines[2]])
    batch = wait_for_batch(http, batch_id)
    assert batch["status"] == "failed"
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [("invalid_json_line", 2)]
    assert [(e["code"], e["line"]) for e in batch["request_errors"]["data"]] == [("unknown_parameter", 1)]
    assert read_batch(http, batch_id)["output_file_id"] is None

"""A Message Batch whose requests name several served models, through the unmodified ``anthropic``
SDK against a live server on PostgreSQL and SeaweedFS: the deployment serves two tiny random chat
models (a Llama and a Qwen2), each run by a shard runner of its own in this process, as a worker
runs one chat model. Each request runs on the model it names, in shards of that model that only
its runner claims; a request naming a model not served errors alone; the usage and cost are
priced per model, and the usage and cost reports split the batch by model and add up to it; a
retry takes only the failed request."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal

import anthropic
import httpx
import pytest
from sqlalchemy import select

from batchapi.batches.billing import PRICES, cost, discounted, list_amount
from batchapi.db.migrate import upgrade
from batchapi.db.models import Batch, Shard
from batchapi.openai.errors import ErrorCode
from batchapi.workers.engine_setup import start_runner
from tests.utils import services
from tests.utils.batch_service import EMBEDDED, live_server, new_key, service_settings
from tests.utils.waiting import wait_for_message_batch

# named after two models of the price table (copies of the tiny models), so each has a price of its own
FIRST, SECOND = "smollm2-135m-instruct", "smollm2-360m-instruct"


class ModelWorkers:
    """The embedded worker's part for several chat models: one shard runner per model, each on
    settings that serve its model alone (``batchapi worker`` per model in production)."""

    def __init__(self, model_dirs: list[str]):
        self.model_dirs = model_dirs
        self.runners = {}
        self.ready: list[tuple[str, list[str], str | None]] = []  # what the API dispatched, as Celery would route it

    def batch_ready(self, batch_id: str, shard_ids: list[str], model: str | None = None) -> None:
        self.ready.append((batch_id, shard_ids, model))
        for runner in self.runners.values():
            runner.wake()

    def batch_cancelled(self, batch_id: str) -> None:
        for runner in self.runners.values():
            runner.abort_batch(batch_id, ErrorCode.BATCH_CANCELLED)

    @contextmanager
    def run(self, ctx) -> Iterator[ModelWorkers]:
        try:
            for model_dir in self.model_dirs:
                own = ctx.settings.model_copy(update={"model": model_dir, "models": [model_dir]})
                runner = start_runner(dataclasses.replace(ctx, settings=own))
                self.runners[runner.models[0]] = runner
            yield self
        finally:
            for runner in self.runners.values():
                runner.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, tiny_qwen2_dir, s3):
    models = tmp_path_factory.mktemp("models")
    dirs = [str(shutil.copytree(tiny_llama_dir, models / FIRST)), str(shutil.copytree(tiny_qwen2_dir, models / SECOND))]
    workers = ModelWorkers(dirs)
    with services.fresh_database("batchapi_msgbatch_models") as pg_url:
        settings = service_settings(tmp_path_factory.mktemp("data"), dirs[0], pg_url=pg_url, s3=s3,
                                    **{**EMBEDDED, "models": dirs, "shard_size": 2, "max_num_seqs": 8,
                                       "engine_process": False, "auth_required": True})
        upgrade(settings)
        with live_server(settings, dispatcher=workers, hook=workers.run, sweep_shards=True) as server:
            server.worker = workers
            yield server


@pytest.fixture
def key(server, request) -> str:
    return new_key(server, f"project-{request.node.name}")


@pytest.fixture
def client(server, key) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def params(model: str, text: str) -> dict:
    return {"model": model, "max_tokens": 6, "messages": [{"role": "user", "content": text}]}


def test_each_request_runs_on_its_model_and_is_priced_by_it(server, client, key):
    requests = [{"custom_id": f"r{i}", "params": params((FIRST, SECOND)[i % 2], f"Count to {i}.")} for i in range(7)]
    requests.insert(3, {"custom_id": "ghost", "params": params("no-such-model", "Hello.")})
    batch = client.messages.batches.create(requests=requests)
    batch = wait_for_message_batch(client, batch.id, timeout=600)
    assert batch.request_counts.model_dump() == {"processing": 0, "succeeded": 7, "errored": 1, "canceled": 0,
                                                 "expired": 0}
    got = {item.custom_id: item.result for item in client.messages.batches.results(batch.id)}
    assert set(got) == {r["custom_id"] for r in requests}
    assert got["ghost"].type == "errored" and got["ghost"].error.error.type == "invalid_request_error"
    assert "no-such-model" in got["ghost"].error.error.message
    named = {r["custom_id"]: r["params"]["model"] for r in requests if r["custom_id"] != "ghost"}
    assert {c: got[c].type for c in named} == dict.fromkeys(named, "succeeded")
    assert {c: got[c].message.model for c in named} == named  # each ran on the model it names

    row_id = "batch_" + batch.id.removeprefix("msgbatch_")
    with server.ctx.sessions() as session:
        row = session.get(Batch, row_id)
        shards = list(session.scalars(select(Shard).where(Shard.batch_id == row_id).order_by(Shard.index)))
    # shards per model (the unserved request in the first model's, whose worker refused it), each
    # taken by its model's runner only, its own lines named where other models' lie between
    assert [(s.model, s.lines) for s in shards] == [(FIRST, [1, 3]), (FIRST, [4, 6]), (FIRST, [8]),
                                                   (SECOND, [2, 5]), (SECOND, [7])]
    owners = {model: runner.owner for model, runner in server.worker.runners.items()}
    assert [s.lease_owner for s in shards] == [owners[s.model] for s in shards]
    assert [(ids, model) for bid, ids, model in server.worker.ready if bid == row_id] == [
        ([s.id for s in shards if s.model == m], m) for m in (FIRST, SECOND)]  # each model's shards to its queue

    # usage and cost per model: each model's messages, at its own price
    assert row.model == FIRST and list(row.per_model) == [FIRST, SECOND]
    expected = Decimal(0)
    for model in (FIRST, SECOND):
        messages = [got[c].message for c in named if named[c] == model]
        uncached, cached, output = (sum(getattr(m.usage, f) for m in messages)
                                    for f in ("input_tokens", "cache_read_input_tokens", "output_tokens"))
        share = row.per_model[model]
        assert (share["request_completed"], share["request_failed"]) == (len(messages), 1 if model == FIRST else 0)
        assert (share["input_tokens"], share["cached_tokens"], share["output_tokens"]) == (uncached + cached, cached,
                                                                                           output)
        price = PRICES[model]
        assert share["price"] == [str(price.input), str(price.cached_input), str(price.output)]
        expected += discounted(list_amount(price, uncached + cached, cached, output), row.discount_percent)
    assert (row.input_tokens, row.output_tokens) == tuple(
        sum(row.per_model[m][f] for m in row.per_model) for f in ("input_tokens", "output_tokens"))
    assert cost(row).amount == expected and expected > 0

    # the reports split the batch by model and add up to its cost
    http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"})
    span = {"start_time": int(batch.created_at.timestamp()) - 60, "end_time": int(time.time()) + 3600}
    usage = http.get("/v1/organization/usage/completions", params={**span, "group_by": "model"}).json()
    by_model = {r["model"]: r for bucket in usage["data"] for r in bucket["results"]}
    assert {m: (r["num_model_requests"], r["output_tokens"]) for m, r in by_model.items()} == {
        m: (row.per_model[m]["request_completed"], row.per_model[m]["output_tokens"]) for m in (FIRST, SECOND)}
    costs = http.get("/v1/organization/costs", params={**span, "group_by": "line_item"}).json()
    items = {r["line_item"]: Decimal(str(r["amount"]["value"])) for b in costs["data"] for r in b["results"]}
    assert {item.split(",")[0] for item in items} == {FIRST, SECOND}
    assert sum(items.values()) == expected
    assert Decimal(http.get(f"/v1/batches/{row_id}").json()["cost"]["amount"]) == expected

    # a retry takes exactly the request that failed, found by its shard's own lines
    retry = http.post(f"/v1/batches/{row_id}/retry").json()
    content = http.get(f"/v1/files/{retry['input_file_id']}/content").content
    assert [json.loads(line)["custom_id"] for line in content.splitlines()] == ["ghost"]

"""Anthropic's Message Batches API through the unmodified ``anthropic`` SDK, against a live server on
PostgreSQL and SeaweedFS with the embedded worker and the tiny random model: create, retrieve,
results (each custom_id once, parsed as the SDK's types), list paging, cancel, delete (the batch
still billed in the reports), a request with bad params errored alone, auth in Anthropic's error
shape, usage and cost reconciled with the underlying batch, a forced tool call that validates
against its input_schema, and a refused create that leaves no file."""

from __future__ import annotations

import json
import time
from decimal import Decimal

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message
from sqlalchemy import func, select

from batchapi.batches.billing import cost
from batchapi.db.models import Batch, Shard
from tests.utils.batch_service import embedded_stack, new_key
from tests.utils.waiting import wait_for_message_batch

SETTINGS = dict(shard_size=4, max_num_seqs=16, auth_required=True)
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, s3):
    with embedded_stack(tmp_path_factory.mktemp("msgbatch"), tiny_llama_dir, "message_batches", s3,
                        **SETTINGS) as server:
        yield server


@pytest.fixture
def key(server, request) -> str:
    return new_key(server, f"project-{request.node.name}")


@pytest.fixture
def client(server, key) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def params(model: str, text: str = "Say hello.", **extra) -> dict:
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}], **extra}


def results(client: anthropic.Anthropic, batch_id: str) -> dict:
    out = {}
    for item in client.messages.batches.results(batch_id):
        assert item.custom_id not in out, f"{item.custom_id} twice"
        out[item.custom_id] = item.result
    return out


def test_create_retrieve_and_results_with_one_errored_request(client, model, server):
    requests = [{"custom_id": f"r{i}", "params": params(model, f"Count to {i}.", temperature=0.5)} for i in range(5)]
    requests.append({"custom_id": "bad", "params": params(model, temperature=3)})
    requests.append({"custom_id": "sys", "params": params(model, system=[{"type": "text", "text": "Be brief."}],
                                                          stop_sequences=["\n\n"], top_k=5)})
    batch = client.messages.batches.create(requests=requests)
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 7 and batch.created_at.tzinfo is not None
    batch = wait_for_message_batch(client, batch.id)
    assert batch.request_counts.model_dump() == {"processing": 0, "succeeded": 6, "errored": 1, "canceled": 0,
                                                 "expired": 0}
    assert batch.ended_at is not None and batch.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    got = results(client, batch.id)
    assert set(got) == {r["custom_id"] for r in requests}
    assert got["bad"].type == "errored"
    assert got["bad"].error.error.type == "invalid_request_error" and "temperature" in got["bad"].error.error.message
    for custom_id in set(got) - {"bad"}:
        message = got[custom_id].message
        assert got[custom_id].type == "succeeded" and isinstance(message, Message)
        assert message.id.startswith("msg_") and message.role == "assistant" and message.model == model
        assert message.content[0].type == "text" and message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
        assert 0 < message.usage.output_tokens <= 8 and message.usage.cache_creation_input_tokens == 0

    # one engine, two wire formats: the underlying batch's usage and cost are the messages' sums
    row_id = "batch_" + batch.id.removeprefix("msgbatch_")
    with server.ctx.sessions() as session:
        row = session.get(Batch, row_id)
    messages = [got[c].message for c in got if c != "bad"]
    prompt = sum(m.usage.input_tokens + m.usage.cache_read_input_tokens for m in messages)
    assert (row.endpoint, row.input_tokens, row.output_tokens) == (
        "/v1/messages", prompt, sum(m.usage.output_tokens for m in messages))
    assert row.cached_tokens == sum(m.usage.cache_read_input_tokens for m in messages)
    uncached, cached, output = (sum(getattr(m.usage, f) for m in messages) for f in (
        "input_tokens", "cache_read_input_tokens", "output_tokens"))
    listed = (uncached * row.price_input + cached * row.price_cached_input + output * row.price_output) / 10**6
    assert Decimal(cost(row).as_dict()["list_amount"]) == listed.quantize(Decimal("1e-8"))


def test_results_url_is_on_the_public_url_when_one_is_set(client, model, server, monkeypatch):
    created = client.messages.batches.create(requests=[{"custom_id": "a", "params": params(model)}])
    batch = wait_for_message_batch(client, created.id)
    assert batch.results_url.startswith(server.base_url)  # the request's own host by default
    monkeypatch.setattr(server.ctx.settings, "public_url", "https://batch.example.com/api")
    again = client.messages.batches.retrieve(batch.id)
    assert again.results_url == f"https://batch.example.com/api/v1/messages/batches/{batch.id}/results"
    assert {b.results_url for b in client.messages.batches.list() if b.id == batch.id} == {again.results_url}


def test_list_pages_newest_first_with_after_and_before(client, model):
    ids = [client.messages.batches.create(requests=[{"custom_id": "a", "params": params(model)}]).id
           for _ in range(3)]
    first = client.messages.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert first.first_id == ids[2] and first.last_id == ids[1]
    assert [b.id for b in client.messages.batches.list(limit=2, after_id=ids[1]).data] == [ids[0]]
    assert [b.id for b in client.messages.batches.list(limit=5, before_id=ids[0]).data] == [ids[2], ids[1]]
    assert [b.id for b in client.messages.batches.list(limit=1)] == ids[::-1]  # the SDK pages on its own
    for batch_id in ids:
        wait_for_message_batch(client, batch_id)


def test_cancel_ends_canceled_and_delete_removes_an_ended_batch(client, model):
    requests = [{"custom_id": f"c{i}", "params": params(model, max_tokens=400)} for i in range(12)]
    batch = client.messages.batches.create(requests=requests)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.delete(batch.id)  # not ended yet
    canceled = client.messages.batches.cancel(batch.id)
    assert canceled.processing_status in ("canceling", "ended") and canceled.cancel_initiated_at is not None
    batch = wait_for_message_batch(client, batch.id)
    got = results(client, batch.id)
    assert set(got) == {r["custom_id"] for r in requests}
    kinds = [r.type for r in got.values()]
    assert "canceled" in kinds and set(kinds) <= {"canceled", "succeeded"}
    counts = batch.request_counts
    assert (counts.canceled, counts.succeeded, counts.processing) == (kinds.count("canceled"),
                                                                      kinds.count("succeeded"), 0)
    assert client.messages.batches.cancel(batch.id).processing_status == "ended"  # ended stays ended

    deleted = client.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.batches.retrieve(batch.id)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"


def test_a_forced_tool_call_validates_against_its_input_schema(client, model):
    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "unit": "c"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                                     {"type": "text", "text": "And in Rome?"}]},
    ]
    requests = [{"custom_id": f"t{i}", "params": {"model": model, "max_tokens": 120, "messages": conversation,
                                                   "tools": [tool], "tool_choice": {"type": "tool",
                                                                                    "name": "get_weather"}}}
                for i in range(2)]
    batch = wait_for_message_batch(client, client.messages.batches.create(requests=requests).id)
    got = results(client, batch.id)
    for result in got.values():
        assert result.type == "succeeded", result
        message = result.message
        assert message.stop_reason == "tool_use" and len(message.content) == 1
        block = message.content[0]
        assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
        jsonschema.validate(block.input, WEATHER)


def test_malformed_envelopes_are_refused_whole(client, model):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.batches.create(requests=[{"custom_id": "x", "params": params(model)},
                                                 {"custom_id": "x", "params": params(model)}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "more than once" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=[{"params": params(model)}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_nope")


def test_a_wrong_api_key_is_an_anthropic_authentication_error(server, model):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client.messages.batches.list()
    assert caught.value.status_code == 401
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": caught.value.body["error"]["message"]},
                                 "request_id": caught.value.response.headers["x-request-id"]}
    # the OpenAI routes keep their own shape
    response = httpx.get(f"{server.base_url}/v1/batches", headers={"Authorization": "Bearer sk-wrong"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"


def test_another_projects_batch_is_not_found(server, client, model):
    batch = client.messages.batches.create(requests=[{"custom_id": "a", "params": params(model)}])
    other = anthropic.Anthropic(base_url=server.base_url, api_key=new_key(server, "project-other"), max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        other.messages.batches.retrieve(batch.id)
    wait_for_message_batch(client, batch.id)


def test_a_request_for_a_model_not_served_or_past_the_context_errors_alone(client, model):
    """Anthropic validates each request on its own, the first one included: neither the create nor
    the batch fails for one request's model or length, as an OpenAI batch's file would."""
    requests = [{"custom_id": "other", "params": params("no-such-model")}, {"custom_id": "ok", "params": params(model)},
                {"custom_id": "long", "params": params(model, "word " * 600)},
                {"custom_id": "wants", "params": {**params(model), "max_tokens": 600}}]
    batch = client.messages.batches.create(requests=requests)
    batch = wait_for_message_batch(client, batch.id)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (1, 3)
    got = results(client, batch.id)
    assert got["ok"].type == "succeeded" and got["ok"].message.model == model
    assert {c: got[c].type for c in ("other", "long", "wants")} == dict.fromkeys(("other", "long", "wants"), "errored")
    assert "no-such-model" in got["other"].error.error.message
    assert "context" in got["long"].error.error.message and "max_tokens" in got["wants"].error.error.message
    assert all(got[c].error.error.type == "invalid_request_error" for c in ("other", "long", "wants"))


def test_a_deleted_batch_stays_billed_and_is_gone_from_every_route(server, client, key, model):
    requests = [{"custom_id": f"u{i}", "params": params(model, f"Name {i} fruits.")} for i in range(3)]
    batch = wait_for_message_batch(client, client.messages.batches.create(requests=requests).id)
    http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"})
    span = {"start_time": int(batch.created_at.timestamp()) - 60, "end_time": int(time.time()) + 3600}
    paths = ("/v1/organization/usage/completions", "/v1/organization/costs")
    before = [http.get(path, params=span).json() for path in paths]
    usage = [r for bucket in before[0]["data"] for r in bucket["results"]]
    assert [(r["num_model_requests"], r["output_tokens"] > 0) for r in usage] == [(3, True)]
    assert [r["amount"]["value"] > 0 for bucket in before[1]["data"] for r in bucket["results"]] == [True]

    client.messages.batches.delete(batch.id)
    assert [http.get(path, params=span).json() for path in paths] == before
    assert batch.id not in [b.id for b in client.messages.batches.list()]
    for gone in (lambda: client.messages.batches.retrieve(batch.id), lambda: client.messages.batches.cancel(batch.id),
                 lambda: client.messages.batches.delete(batch.id), lambda: list(client.messages.batches.results(batch.id))):
        with pytest.raises(anthropic.NotFoundError) as caught:
            gone()
        assert caught.value.body["error"]["type"] == "not_found_error"
    assert batch.id not in [b.id for b in client.messages.batches.list(after_id=batch.id)]  # a cursor still
    assert http.get("/v1/files").json()["data"] == []  # the input, output and error files went
    row_id = "batch_" + batch.id.removeprefix("msgbatch_")
    for path in (f"/v1/batches/{row_id}", f"/v1/batches/{row_id}/partial_results"):  # nor on OpenAI's routes
        assert http.get(path).status_code == 404, path
    assert row_id not in [b["id"] for b in http.get("/v1/batches").json()["data"]]
    with server.ctx.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Shard).where(
            Shard.batch_id == "batch_" + batch.id.removeprefix("msgbatch_"))) == 0


def test_a_deleted_batchs_idempotency_key_makes_a_new_batch(server, client, key, model):
    http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"})
    line = {"custom_id": "k", "method": "POST", "url": "/v1/messages", "body": params(model)}
    file_id = http.post("/v1/files", files={"file": ("m.jsonl", json.dumps(line).encode())},
                        data={"purpose": "batch"}).json()["id"]
    create = {"input_file_id": file_id, "endpoint": "/v1/messages", "completion_window": "24h"}
    first = http.post("/v1/batches", json=create, headers={"Idempotency-Key": "nightly"}).json()["id"]
    assert http.post("/v1/batches", json=create, headers={"Idempotency-Key": "nightly"}).json()["id"] == first
    wait_for_message_batch(client, "msgbatch_" + first.removeprefix("batch_"))
    client.messages.batches.delete("msgbatch_" + first.removeprefix("batch_"))
    file_id = http.post("/v1/files", files={"file": ("m.jsonl", json.dumps(line).encode())},
                        data={"purpose": "batch"}).json()["id"]
    again = http.post("/v1/batches", json={**create, "input_file_id": file_id}, headers={"Idempotency-Key": "nightly"})
    assert again.status_code == 200 and again.json()["id"] != first


def test_the_100001st_request_is_refused_in_anthropics_shape(client):
    requests = [{"custom_id": f"r{i}", "params": {}} for i in range(100_001)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.batches.create(requests=requests)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"] == {"type": "invalid_request_error",
                                          "message": "requests: at most 100000 requests per batch, got 100001"}

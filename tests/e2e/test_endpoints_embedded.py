"""Every wire format on the embedded default (SQLite, a local storage directory, the embedded
worker serving a chat model and the embedding model): a batch on /v1/responses, /v1/embeddings
and Anthropic's Message Batches runs end to end through the unmodified SDKs, and a cancel right
after create ends each with every request accounted for once (or, when it lands while the file
is still validating, with no request accepted)."""

from __future__ import annotations

import json

import anthropic
import pytest
from openai.types import CreateEmbeddingResponse
from openai.types.responses import Response

from tests.utils.batch_service import embedded_stack, jsonl, run_to_end
from tests.utils.waiting import wait_for_batch, wait_for_message_batch

SETTINGS = dict(shard_size=2, max_num_seqs=8, kv_cache_gb=0.05, auth_required=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, minilm_dir):
    with embedded_stack(tmp_path_factory.mktemp("embedded-endpoints"), tiny_llama_dir, None,
                        models=[str(tiny_llama_dir), str(minilm_dir)], **SETTINGS) as server:
        assert server.ctx.settings.sqlalchemy_url.startswith("sqlite")
        yield server


@pytest.fixture(scope="module")
def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def models(openai_client) -> dict[str, str]:
    ids = [m.id for m in openai_client.models.list()]
    chat = next(i for i in ids if "minilm" not in i)
    embedding = next(i for i in ids if "minilm" in i)
    return {"chat": chat, "embedding": embedding}


def lines(url: str, count: int, body) -> list[dict]:
    return [{"custom_id": f"r{i}", "method": "POST", "url": url, "body": body(i)} for i in range(count)]


def test_responses_and_embeddings_batches_run_on_the_embedded_default(openai_client, models):
    responses = lines("/v1/responses", 3, lambda i: {"model": models["chat"], "input": f"Say {i}.",
                                                      "max_output_tokens": 4, "temperature": 0})
    batch, output, errors = run_to_end(openai_client, responses, "/v1/responses")
    assert errors == {} and sorted(output) == ["r0", "r1", "r2"]
    usage = [Response.model_validate(r["response"]["body"]).usage for r in output.values()]
    assert batch.usage.output_tokens == sum(u.output_tokens for u in usage)

    embeddings = lines("/v1/embeddings", 3, lambda i: {"model": models["embedding"], "input": [f"text {i}", "more"]})
    batch, output, errors = run_to_end(openai_client, embeddings, "/v1/embeddings")
    assert errors == {} and sorted(output) == ["r0", "r1", "r2"]
    bodies = [CreateEmbeddingResponse.model_validate(r["response"]["body"]) for r in output.values()]
    assert all(len(b.data) == 2 and len(b.data[0].embedding) == 384 for b in bodies)
    assert batch.usage.input_tokens == sum(b.usage.prompt_tokens for b in bodies)


def test_message_batches_run_on_the_embedded_default(anthropic_client, models):
    requests = [{"custom_id": f"m{i}", "params": {"model": models["chat"], "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": f"Hi {i}"}]}}
                for i in range(3)]
    batch = anthropic_client.messages.batches.create(requests=requests)
    batch = wait_for_message_batch(anthropic_client, batch.id)
    results = {r.custom_id: r.result for r in anthropic_client.messages.batches.results(batch.id)}
    assert sorted(results) == ["m0", "m1", "m2"] and {r.type for r in results.values()} == {"succeeded"}
    assert batch.request_counts.succeeded == 3


@pytest.mark.parametrize("url", ["/v1/responses", "/v1/embeddings"])
def test_a_cancel_right_after_create_accounts_for_every_request_once(openai_client, models, url, tmp_path):
    if url == "/v1/embeddings":
        body = lambda i: {"model": models["embedding"], "input": [f"input {i} {j}" for j in range(64)]}  # noqa: E731
    else:
        body = lambda i: {"model": models["chat"], "input": f"Count to {i}.", "max_output_tokens": 64}  # noqa: E731
    requests = lines(url, 40, body)
    uploaded = openai_client.files.create(file=("batch.jsonl", jsonl(requests)), purpose="batch")
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h")
    openai_client.batches.cancel(batch.id)
    batch = wait_for_batch(openai_client, batch.id, {"cancelled"}, timeout=60, interval=0.3)
    seen = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            seen.extend(json.loads(x)["custom_id"]
                        for x in openai_client.files.content(file_id).text.splitlines())
    if batch.request_counts.total == 0:  # cancelled while validating: no request was accepted, none ran
        assert seen == [] and batch.in_progress_at is None
    else:
        assert sorted(seen) == sorted(r["custom_id"] for r in requests)


def test_a_message_batch_cancel_ends_it_with_every_request_once(anthropic_client, models):
    requests = [{"custom_id": f"c{i}", "params": {"model": models["chat"], "max_tokens": 64,
                                                  "messages": [{"role": "user", "content": f"Count to {i}"}]}}
                for i in range(40)]
    requests[5]["params"]["temperature"] = 9  # refused alone: errored, whatever the cancel does
    batch = anthropic_client.messages.batches.create(requests=requests)
    assert anthropic_client.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
    batch = wait_for_message_batch(anthropic_client, batch.id)
    results = {r.custom_id: r.result.type for r in anthropic_client.messages.batches.results(batch.id)}
    assert sorted(results) == sorted(r["custom_id"] for r in requests)
    kinds = list(results.values())
    counts = batch.request_counts
    assert counts.processing == 0 and counts.expired == 0
    # the counts say what the results say, request by request
    assert (counts.succeeded, counts.errored, counts.canceled) == (
        kinds.count("succeeded"), kinds.count("errored"), kinds.count("canceled"))

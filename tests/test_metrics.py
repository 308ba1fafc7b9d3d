"""``/metrics`` of the embedded default: counters equal to the batches' own usage after they run,
the engine's gauges and step histogram, the embedding model's encoder under the same names, HTTP
latency by route template."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.utils.batch_service import CHAT, embedded_stack, new_key, request_line, run_to_end
from tests.utils.scrape import scrape, usage_counters

EMBEDDINGS = "/v1/embeddings"
EMBEDDING = "all-minilm-l6-v2"  # the embedded default's embedding model


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_llama_dir, minilm_dir):
    """As the embedded default: a chat model and the embedding model, on SQLite."""
    with embedded_stack(tmp_path_factory.mktemp("metrics"), tiny_llama_dir, None,
                        models=[str(tiny_llama_dir), str(minilm_dir)]) as server:
        yield server


def test_counters_equal_the_batches_usage_in_the_embedded_default(embedded):
    client = OpenAI(base_url=embedded.base_url + "/v1", api_key=new_key(embedded, "metrics"), max_retries=0)
    model = embedded.app.state.model.id
    labels = (("model", model),)
    generated_before = scrape(embedded.base_url).get(("batchapi_engine_generation_tokens_total", labels), 0.0)
    batches = []
    for n in (5, 3):
        lines = [request_line(f"r{i}", model, f"Count to {i}.", max_tokens=6, temperature=0) for i in range(n)]
        batch, _, _ = run_to_end(client, lines, CHAT, timeout=300)
        batches.append(batch)
    samples = scrape(embedded.base_url)

    assert usage_counters(samples, model) == {
        "input_tokens": sum(b.usage.input_tokens for b in batches),
        "cached_input_tokens": sum(b.usage.input_tokens_details.cached_tokens for b in batches),
        "output_tokens": sum(b.usage.output_tokens for b in batches),
        "model_requests": sum(b.request_counts.completed for b in batches),
    }
    assert samples[("batchapi_batches", (("status", "completed"),))] == 2
    assert samples[("batchapi_requests_finished_total", (("outcome", "succeeded"),))] == 8
    assert samples[("batchapi_requests_finished_total", (("outcome", "errored"),))] == 0
    assert samples[("batchapi_shard_lease_recoveries_total", ())] == 0
    assert ("batchapi_shards", (("model", model), ("status", "queued"))) not in samples  # nothing left queued

    # the engine of this process: its own count of what it generated agrees with the bill (the
    # counter is the process's: in a test run other engines of the same model counted before)
    generated = samples[("batchapi_engine_generation_tokens_total", labels)] - generated_before
    assert generated == sum(b.usage.output_tokens for b in batches)
    assert samples[("batchapi_engine_step_seconds_count", labels)] > 0
    assert samples[("batchapi_engine_running_sequences", labels)] == 0
    assert samples[("batchapi_engine_waiting_sequences", labels)] == 0
    assert 0 <= samples[("batchapi_engine_kv_cache_usage_ratio", labels)] <= 1
    assert samples[("batchapi_engine_generation_tokens_per_second", labels)] >= 0


def test_http_latency_by_route_template(embedded):
    key = new_key(embedded, "metrics-http")
    for batch_id in ("batch_a", "batch_b"):
        httpx.get(f"{embedded.base_url}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"})
    httpx.get(f"{embedded.base_url}/no/such/path")
    samples = scrape(embedded.base_url)
    route = (("method", "GET"), ("route", "/v1/batches/{batch_id}"), ("status", "404"))
    assert samples[("batchapi_http_request_duration_seconds_count", route)] >= 2
    assert samples[("batchapi_http_request_duration_seconds_count",
                    (("method", "GET"), ("route", "unmatched"), ("status", "404")))] >= 1
    assert not any("batch_a" in str(labels) for _, labels in samples)  # ids never become labels


def test_the_encoders_series_in_the_embedded_default(embedded):
    """After the tests above: it adds a completed batch."""
    client = OpenAI(base_url=embedded.base_url + "/v1", api_key=new_key(embedded, "metrics-embeddings"), max_retries=0)
    labels = (("model", EMBEDDING),)
    names = ("batchapi_engine_embeddings_total", "batchapi_engine_prompt_tokens_total",
             "batchapi_engine_step_seconds_count")
    before = scrape(embedded.base_url)
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": EMBEDDINGS,
              "body": {"model": EMBEDDING, "input": [f"Sentence number {i}.", "hello"]}} for i in range(3)]
    batch, output, _ = run_to_end(client, lines, EMBEDDINGS, timeout=300)
    assert len(output) == 3
    samples = scrape(embedded.base_url)
    embeddings, prompt_tokens, steps = (samples[(name, labels)] - before.get((name, labels), 0.0) for name in names)
    assert embeddings == 6
    assert prompt_tokens == batch.usage.input_tokens > 0
    assert steps >= 1
    assert samples[("batchapi_engine_running_sequences", labels)] == 0
    assert samples[("batchapi_engine_waiting_sequences", labels)] == 0
    assert samples[("batchapi_engine_generation_tokens_total", labels)] == 0
    # the chat model's own series stay apart
    assert ("batchapi_engine_embeddings_total", (("model", embedded.app.state.model.id),)) not in samples

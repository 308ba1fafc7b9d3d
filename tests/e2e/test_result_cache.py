"""The result cache, through the openai SDK against a live server on PostgreSQL and SeaweedFS with
the embedded worker: a greedy or seeded request run again in a later batch of the same project is
answered from the first run's result (the same response body, no engine work, charged nothing), as
is a copy of one within the same shard,
a sampled request without a seed runs again, another project's batch and a batch created with
``result_cache: false`` run everything, and an output file deleted or expired ends its entries."""

from __future__ import annotations

import dataclasses
import io
import json

import httpx
import pytest
from openai import OpenAI
from sqlalchemy import func, select, update

from batchapi.batches import result_cache
from batchapi.db.clock import now
from batchapi.db.models import File, ResultCacheEntry
from batchapi.db.session import session_scope
from tests.utils.batch_service import CHAT, embedded_stack, jsonl, new_key, request_line
from tests.utils.scrape import scrape
from tests.utils.waiting import wait_for_batch, wait_until

SETTINGS = dict(shard_size=4, max_num_seqs=8, result_cache=True)  # tests/utils turns it off by default


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, s3):
    with embedded_stack(tmp_path_factory.mktemp("cache"), tiny_llama_dir, "result_cache", s3, **SETTINGS) as server:
        yield server


def lines(model: str, prefix: str, sampled: bool = True) -> list[dict]:
    out = [request_line(f"{prefix}greedy-1", model, "Say hello.", max_tokens=5, temperature=0),
           request_line(f"{prefix}greedy-2", model, "Name a colour.", max_tokens=5, temperature=0),
           request_line(f"{prefix}seeded", model, "Count to three.", max_tokens=5, temperature=1.0, seed=7)]
    if sampled:
        out.append(request_line(f"{prefix}sampled", model, "Tell a story.", max_tokens=5, temperature=1.0))
    return out


def run(server, key: str, batch_lines: list[dict], **extra):
    """(batch object as JSON, {custom_id: output line}, engine prompt tokens spent on it)."""
    client = OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    metric = ("batchapi_engine_prompt_tokens_total", (("model", server.app.state.model.id),))
    before = scrape(server.base_url).get(metric, 0.0)
    uploaded = client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(batch_lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                  extra_body=extra or None)
    batch = wait_for_batch(client, batch.id, timeout=300, interval=0.3)
    assert batch.status == "completed", batch.errors
    assert batch.error_file_id is None or not client.files.content(batch.error_file_id).text.strip()
    spent = scrape(server.base_url).get(metric, 0.0) - before
    shown = httpx.get(f"{server.base_url}/v1/batches/{batch.id}", headers={"Authorization": f"Bearer {key}"}).json()
    records = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    return shown, {r["custom_id"]: r for r in records}, spent


def test_a_rerun_is_answered_from_the_cache_and_charged_nothing(server):
    model = server.app.state.model.id
    key = new_key(server, "cache-rerun")
    first, first_out, first_spent = run(server, key, lines(model, ""))
    assert first_spent > 0 and "cached_requests" not in first["cost"]

    second, second_out, spent = run(server, key, lines(model, "again-"))
    assert set(second_out) == {f"again-{name}" for name in ("greedy-1", "greedy-2", "seeded", "sampled")}
    for name in ("greedy-1", "greedy-2", "seeded"):  # the same body (its id and usage too) under the new custom_id
        record, original = second_out[f"again-{name}"], first_out[name]
        assert record["response"]["body"] == original["response"]["body"]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert record["id"] != original["id"] and record["response"]["request_id"] != original["response"]["request_id"]
    sampled = second_out["again-sampled"]["response"]["body"]["usage"]
    # only the sampled request ran, and only it is charged
    assert spent == sampled["prompt_tokens"]
    assert second["usage"]["input_tokens"] == sampled["prompt_tokens"]
    assert second["usage"]["output_tokens"] == sampled["completion_tokens"]
    assert second["cost"]["cached_requests"] == 3 and float(second["cost"]["cached_amount"]) > 0
    assert second["request_counts"] == {"total": 4, "completed": 4, "failed": 0}

    third, third_out, spent = run(server, key, lines(model, "third-", sampled=False))
    assert spent == 0  # no engine work at all
    assert third["cost"]["amount"] == "0.00" and third["cost"]["list_amount"] == "0.00"
    assert third["cost"]["cached_requests"] == 3
    assert third["usage"]["input_tokens"] == 0 and third["usage"]["output_tokens"] == 0
    assert third_out["third-greedy-1"]["response"]["body"] == first_out["greedy-1"]["response"]["body"]

    # the deployment setting: BATCHAPI_RESULT_CACHE=false finds nothing
    with server.ctx.sessions() as session:
        keys = set(session.scalars(select(ResultCacheEntry.key).where(ResultCacheEntry.batch_id == first["id"])))
    assert len(keys) == 3 and set(result_cache.lookup(server.ctx, third["id"], keys)) == keys
    off = dataclasses.replace(server.ctx, settings=server.ctx.settings.model_copy(update={"result_cache": False}))
    assert result_cache.lookup(off, third["id"], keys) == {}


def test_identical_requests_of_a_shard_run_once(server):
    """Copies of a greedy or seeded request within one shard run once: each copy's line carries the
    first's response body under its own custom_id, charged nothing and counted as cached, and the
    cache keeps the usage the first had; sampled copies without a seed each run."""
    model = server.app.state.model.id
    key = new_key(server, "cache-copies")
    copies = [request_line("a-1", model, "Say hello.", max_tokens=5, temperature=0),
              request_line("b-1", model, "Count to three.", max_tokens=5, temperature=1.0, seed=7),
              request_line("a-2", model, "Say hello.", max_tokens=5, temperature=0),
              request_line("b-2", model, "Count to three.", max_tokens=5, temperature=1.0, seed=7)]  # one shard of 4
    shown, out, spent = run(server, key, copies)
    a, b = out["a-1"]["response"]["body"], out["b-1"]["response"]["body"]
    assert out["a-2"]["response"]["body"] == a and out["b-2"]["response"]["body"] == b
    assert out["a-2"]["id"] != out["a-1"]["id"] and out["b-2"]["id"] != out["b-1"]["id"]
    ran = [a["usage"], b["usage"]]
    assert spent == sum(u["prompt_tokens"] for u in ran)  # the engine saw each once
    assert shown["usage"]["input_tokens"] == spent
    assert shown["usage"]["output_tokens"] == sum(u["completion_tokens"] for u in ran)
    assert shown["cost"]["cached_requests"] == 2 and float(shown["cost"]["cached_amount"]) > 0
    assert shown["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    with server.ctx.sessions() as session:  # the entries keep the usage of the requests that ran
        kept = session.scalars(select(ResultCacheEntry.output_tokens).where(ResultCacheEntry.batch_id == shown["id"]))
        assert sorted(kept) == sorted(u["completion_tokens"] for u in ran)

    sampled = [request_line(f"s-{i}", model, "Tell a story.", max_tokens=5, temperature=1.0) for i in (1, 2)]
    shown, out, spent = run(server, key, sampled)
    assert spent == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out.values())
    assert "cached_requests" not in shown["cost"]


def entries_of(server, batch_id: str) -> int:
    with server.ctx.sessions() as session:
        return session.scalar(select(func.count()).where(ResultCacheEntry.batch_id == batch_id))


def test_another_projects_batch_is_not_served_from_the_cache(server):
    model = server.app.state.model.id
    owner, _, _ = run(server, new_key(server, "cache-owner"), lines(model, "", sampled=False))
    other, _, spent = run(server, new_key(server, "cache-other"), lines(model, "", sampled=False))
    assert spent > 0 and "cached_requests" not in other["cost"]
    assert other["usage"]["input_tokens"] > 0

    # the owner's output file expires: its entries go with it
    assert entries_of(server, owner["id"]) == 3
    with session_scope(server.ctx.sessions) as session:
        session.execute(update(File).where(File.id == owner["output_file_id"]).values(expires_at=now() - 1))
    wait_until(lambda: entries_of(server, owner["id"]) == 0, timeout=30, interval=0.2,
               message="the sweeper to delete the expired file's entries")


def test_a_batch_with_the_cache_off_runs_every_request(server):
    model = server.app.state.model.id
    key = new_key(server, "cache-off")
    run(server, key, lines(model, "", sampled=False))
    copies = lines(model, "", sampled=False) + lines(model, "copy-", sampled=False)[:1]  # one shard of 4
    off, out, spent = run(server, key, copies, result_cache=False)
    assert "cached_requests" not in off["cost"]
    assert spent == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out.values())  # the copy ran too
    assert out["copy-greedy-1"]["response"]["body"]["id"] != out["greedy-1"]["response"]["body"]["id"]
    # a batch with the cache off leaves no entries either
    assert entries_of(server, off["id"]) == 0


def test_a_deleted_output_file_ends_its_entries(server):
    model = server.app.state.model.id
    key = new_key(server, "cache-deleted")
    first, _, _ = run(server, key, lines(model, "", sampled=False))
    assert entries_of(server, first["id"]) == 3
    client = OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    client.files.delete(first["output_file_id"])
    again, _, spent = run(server, key, lines(model, "", sampled=False))
    assert spent > 0 and "cached_requests" not in again["cost"]
    wait_until(lambda: entries_of(server, first["id"]) == 0, timeout=30, interval=0.2, message="the sweeper to delete the entries")

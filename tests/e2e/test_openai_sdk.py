"""The official openai SDK against a live server on PostgreSQL and SeaweedFS."""

from __future__ import annotations

import io

import openai
import pytest
from openai import OpenAI

from batchapi.batches.states import BatchStatus
from batchapi.batches.sweeper import sweep
from batchapi.db.models import Shard
from batchapi.db.session import session_scope
from tests.utils.batch_service import jsonl, new_key, pg_live_server, request_line
from tests.utils.waiting import PAST_VALIDATION, wait_for_batch, wait_until


def upload(client, lines, name="batch.jsonl"):
    return client.files.create(file=(name, io.BytesIO(jsonl(lines))), purpose="batch")


def validated(client, batch_id):
    return wait_for_batch(client, batch_id, PAST_VALIDATION, timeout=30)


def test_upload_create_retrieve_cancel_download(client, model_id):
    lines = [request_line(f"r{i}", model_id, max_tokens=8) for i in range(10)]
    data = jsonl(lines)
    f = upload(client, lines)
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(data), "batch.jsonl")
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == data

    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "nightly"})
    assert batch.status == "validating"
    assert batch.expires_at == batch.created_at + 86400
    assert batch.metadata == {"run": "nightly"}

    batch = validated(client, batch.id)
    assert batch.status == "in_progress", batch.errors
    assert batch.model == model_id
    assert batch.request_counts.total == 10
    assert batch.in_progress_at is not None
    extra = batch.model_extra
    assert extra["cost"] == {"currency": "usd", "amount": "0.00", "list_amount": "0.00"}
    assert float(extra["estimated_cost"]["amount"]) > 0
    assert batch.usage.input_tokens == 0

    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert client.batches.cancel(batch.id).status == "cancelling"  # cancelling again is no error


def test_shards_are_recorded(client, model_id, pg_server):
    f = upload(client, [request_line(f"r{i}", model_id) for i in range(10)])
    batch = validated(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)

    def counted_shards():
        with pg_server.ctx.sessions() as session:
            shards = session.query(Shard).filter_by(batch_id=batch.id).order_by(Shard.index).all()
        return all(s.tokens_counted for s in shards) and shards

    # exact counts arrive shortly after validation
    shards = wait_until(counted_shards, message="every shard's exact token counts")
    assert [(s.first_line, s.last_line, s.request_count, s.status) for s in shards] == [
        (1, 4, 4, "queued"), (5, 8, 4, "queued"), (9, 10, 2, "queued")]
    assert shards[0].start_byte == 0 and shards[-1].end_byte == f.bytes
    assert [len(s.prompt_token_counts) for s in shards] == [4, 4, 2]



def test_list_batches_with_paging(client, model_id):
    f = upload(client, [request_line("a", model_id)])
    ids = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(5)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2]
    assert page.has_more
    assert [b.id for b in client.batches.list(limit=2).iter_pages().__next__().data] == ids[::-1][:2]
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # auto-paging follows `after`
    last = client.batches.list(after=ids[1], limit=10)
    assert [b.id for b in last.data] == [ids[0]] and not last.has_more


def test_list_and_delete_files(client):
    ids = [upload(client, [{"x": i}], name=f"f{i}.jsonl").id for i in range(3)]
    assert [f.id for f in client.files.list()] == ids[::-1]
    assert [f.id for f in client.files.list(order="asc", limit=2)] == ids
    deleted = client.files.delete(ids[0])
    assert deleted.deleted and deleted.id == ids[0]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[0])
    assert [f.id for f in client.files.list()] == ids[:0:-1]
    assert [f.id for f in client.files.list(order="asc", after=ids[0])] == ids[1:]  # a deleted cursor keeps its place
    for f in client.files.list(order="asc", limit=1):  # deleting as it pages: the next page is after a deleted file
        if f.id in ids:
            client.files.delete(f.id)
    assert not {f.id for f in client.files.list()} & set(ids)


def test_validation_errors_come_back_with_line_numbers(client, model_id):
    lines = [request_line("a", model_id), "{oops", request_line("a", model_id), request_line("b", "gpt-4o")]
    f = upload(client, lines)
    batch = validated(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("invalid_json_line", 2), ("duplicate_custom_id", 3), ("mismatched_model", 4)]
    assert batch.model_extra["estimated_cost"] is None


def test_cancel_while_validating_ends_cancelled(client, model_id, pg_server):
    f = upload(client, [request_line(f"r{i}", model_id) for i in range(3)])
    runner_paused = pg_server.ctx.on_batch_created
    pg_server.ctx.on_batch_created = None  # leave it in validating, as if the validator died
    try:
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    finally:
        pg_server.ctx.on_batch_created = runner_paused
    assert client.batches.cancel(batch.id).status == "cancelling"
    from batchapi.batches.leases import settle_cancelled_validation

    assert settle_cancelled_validation(pg_server.ctx, batch.id) == "cancelled"
    assert client.batches.retrieve(batch.id).cancelled_at is not None


def test_a_finished_batch_cannot_be_cancelled(client, model_id, pg_server):
    from batchapi.batches import states

    f = upload(client, [request_line("z", model_id)])
    batch = validated(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    with session_scope(pg_server.ctx.sessions) as session:
        assert states.transition(session, batch.id, BatchStatus.FINALIZING)
        assert states.transition(session, batch.id, BatchStatus.COMPLETED)
    with pytest.raises(openai.ConflictError) as err:
        client.batches.cancel(batch.id)
    assert "completed" in err.value.message


def test_idempotency_key_returns_the_first_batch(client, model_id):
    f = upload(client, [request_line("a", model_id)])
    args = dict(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    first = client.batches.create(**args, extra_headers={"Idempotency-Key": "nightly-42"})
    again = client.batches.create(**args, extra_headers={"Idempotency-Key": "nightly-42"})
    assert again.id == first.id
    other = client.batches.create(**args, extra_headers={"Idempotency-Key": "nightly-43"})
    assert other.id != first.id
    with pytest.raises(openai.ConflictError) as err:
        client.batches.create(**{**args, "completion_window": "48h"}, extra_headers={"Idempotency-Key": "nightly-42"})
    assert err.value.code == "idempotency_key_reused"
    later = {"anchor": "created_at", "seconds": 7200}
    with pytest.raises(openai.ConflictError) as err:  # the output files' expiry is part of the request too
        client.batches.create(**args, output_expires_after=later, extra_headers={"Idempotency-Key": "nightly-42"})
    assert err.value.code == "idempotency_key_reused"
    kept = client.batches.create(**args, output_expires_after=later, extra_headers={"Idempotency-Key": "nightly-44"})
    again = client.batches.create(**args, output_expires_after=later, extra_headers={"Idempotency-Key": "nightly-44"})
    assert again.id == kept.id
    assert len(client.batches.list().data) == 3


def test_partial_results_stream_finished_shards(client, model_id, pg_server, api_key):
    import httpx

    f = upload(client, [request_line(f"r{i}", model_id) for i in range(10)])
    batch = validated(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    ctx = pg_server.ctx
    for index, status in ((1, "succeeded"), (0, "succeeded"), (2, "running")):
        key = f"batches/{batch.id}/shards/{index:05d}.output.jsonl"
        ctx.storage.put_chunks(key, [f'{{"custom_id": "shard{index}"}}\n'.encode()])
        with session_scope(ctx.sessions) as session:
            shard = session.query(Shard).filter_by(batch_id=batch.id, index=index).one()
            shard.status, shard.output_key = status, key
    response = httpx.get(f"{pg_server.base_url}/v1/batches/{batch.id}/partial_results",
                         headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 200
    assert response.text == '{"custom_id": "shard0"}\n{"custom_id": "shard1"}\n'
    errors = httpx.get(f"{pg_server.base_url}/v1/batches/{batch.id}/partial_results?kind=error",
                       headers={"Authorization": f"Bearer {api_key}"})
    assert errors.status_code == 200 and errors.text == ""


def test_models_lists_the_served_model(client, model_id):
    assert [m.id for m in client.models.list()] == [model_id]
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.fixture(scope="module")
def big_shard_server(tmp_path_factory, s3, tiny_llama_dir):
    """A server of its own (and a database of its own), with production-sized shards: at the tests'
    4 requests a shard the 50,000-request batch below would be 12,500 shards, which its cancel then
    closes one by one."""
    with pg_live_server(tmp_path_factory.mktemp("api-big"), tiny_llama_dir, s3, shard_size=1024) as server:
        yield server


def test_large_file_streams_through_s3_multipart_and_validates(big_shard_server, model_id):
    import hashlib

    client = OpenAI(base_url=big_shard_server.base_url + "/v1", api_key=new_key(big_shard_server, "sdk-big"),
                    max_retries=0)

    filler = "w " * 120  # ~370 bytes a line, 50,000 lines: ~18 MB, above the multipart threshold
    data = jsonl([request_line(f"r{i}", model_id, content=filler, max_tokens=4) for i in range(50_000)])
    assert len(data) > 16 * 1024 * 1024
    f = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.bytes == len(data)
    assert hashlib.sha256(client.files.content(f.id).content).digest() == hashlib.sha256(data).digest()
    batch = validated(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert (batch.status, batch.request_counts.total) == ("in_progress", 50_000), batch.errors
    client.batches.cancel(batch.id)  # stop the background count from running on
    # and end it (no worker runs here): its 49 shards close in a second or two
    wait_until(lambda: sweep(big_shard_server.ctx).finalized or client.batches.retrieve(batch.id).status == "cancelled",
               timeout=120, message="the cancelled batch to end")

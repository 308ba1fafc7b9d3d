"""``expires_after`` on files and ``output_expires_after`` on batches, as OpenAI's, with the openai
SDK against the live server on PostgreSQL and SeaweedFS: ``expires_at`` on the objects, bad values
refused naming the param, and the sweeper deleting expired files from storage and the database
(the output files of a finished batch: tests/webhooks/test_end_to_end.py)."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from sqlalchemy import func, select, update

from batchapi.batches.sweeper import sweep
from batchapi.db.models import File
from batchapi.db.session import session_scope
from tests.utils.batch_service import jsonl, request_line
from tests.utils.waiting import wait_for_batch, wait_until

DAY = 86400


def upload(client, model_id, **kwargs):
    data = jsonl([request_line("r1", model_id, max_tokens=4)])
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch", **kwargs)


def expire(server, file_id: str) -> None:
    with session_scope(server.ctx.sessions) as session:
        session.execute(update(File).where(File.id == file_id).values(expires_at=File.created_at))


def row_count(server, file_id: str) -> int:
    with server.ctx.sessions() as session:
        return session.scalar(select(func.count()).select_from(File).where(File.id == file_id))


def storage_key(server, file_id: str) -> str:
    with server.ctx.sessions() as session:
        return session.get(File, file_id).storage_key


def test_files_get_expires_at_from_expires_after_or_30_days(client, model_id):
    f = upload(client, model_id, expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    assert client.files.retrieve(f.id).expires_at == f.created_at + 3600
    default = upload(client, model_id)
    assert default.expires_at == default.created_at + 30 * DAY
    longest = upload(client, model_id, expires_after={"anchor": "created_at", "seconds": 30 * DAY})
    assert longest.expires_at == longest.created_at + 30 * DAY
    assert {x.id: x.expires_at for x in client.files.list()}[f.id] == f.created_at + 3600


@pytest.mark.parametrize("expires_after,param", [
    ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds"),
    ({"anchor": "created_at", "seconds": 30 * DAY + 1}, "expires_after.seconds"),
    ({"anchor": "created_at", "seconds": "soon"}, "expires_after.seconds"),
    ({"anchor": "created_at"}, "expires_after.seconds"),
    ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
])
def test_bad_expires_after_on_a_file_is_refused_naming_the_param(client, model_id, pg_server, expires_after, param):
    with pg_server.ctx.sessions() as session:
        before = session.scalar(select(func.count()).select_from(File))
    with pytest.raises(openai.BadRequestError) as refused:
        upload(client, model_id, expires_after=expires_after)
    error = refused.value.response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    with pg_server.ctx.sessions() as session:
        assert session.scalar(select(func.count()).select_from(File)) == before


def test_expires_after_may_follow_the_file_in_the_form(pg_server, api_key):
    url, headers = pg_server.base_url + "/v1/files", {"Authorization": f"Bearer {api_key}"}
    file = ("in.jsonl", b'{"custom_id": "a"}\n')
    ok = httpx.post(url, headers=headers, files=[("file", file), ("purpose", (None, "batch")),
                                                  ("expires_after[anchor]", (None, "created_at")),
                                                  ("expires_after[seconds]", (None, "7200"))])
    assert ok.status_code == 200, ok.text
    assert ok.json()["expires_at"] == ok.json()["created_at"] + 7200
    bad = httpx.post(url, headers=headers, files=[("file", file), ("purpose", (None, "batch")),
                                                   ("expires_after[anchor]", (None, "created_at")),
                                                   ("expires_after[seconds]", (None, "10"))])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "expires_after.seconds"


@pytest.mark.parametrize("output_expires_after,param", [
    ({"anchor": "created_at", "seconds": 100}, "output_expires_after.seconds"),
    ({"anchor": "created_at", "seconds": "x"}, "output_expires_after.seconds"),
    ({"anchor": "expires_at", "seconds": 3600}, "output_expires_after.anchor"),
])
def test_bad_output_expires_after_is_refused_naming_the_param(client, model_id, output_expires_after, param):
    f = upload(client, model_id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after=output_expires_after)
    assert refused.value.response.json()["error"]["param"] == param


def test_an_expired_file_is_gone_at_once_and_the_sweeper_deletes_it(client, model_id, pg_server):
    f = upload(client, model_id)
    key = storage_key(pg_server, f.id)
    assert pg_server.ctx.storage.exists(key)
    expire(pg_server, f.id)
    with pytest.raises(openai.NotFoundError):  # gone for the API before any sweep
        client.files.retrieve(f.id)
    assert f.id not in {x.id for x in client.files.list()}
    assert f.id in sweep(pg_server.ctx).removed_files
    assert not pg_server.ctx.storage.exists(key)
    assert row_count(pg_server, f.id) == 0


def test_an_expired_file_a_running_batch_reads_is_removed_once_the_batch_ends(client, model_id, pg_server):
    f = upload(client, model_id)
    key = storage_key(pg_server, f.id)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for_batch(client, batch.id, {"in_progress"}, timeout=30)
    expire(pg_server, f.id)
    sweep(pg_server.ctx, shards=True)  # the batch still reads its input (no worker runs it here)
    assert pg_server.ctx.storage.exists(key) and row_count(pg_server, f.id) == 1
    client.batches.cancel(batch.id)
    wait_until(lambda: f.id in sweep(pg_server.ctx).removed_files or row_count(pg_server, f.id) == 0)
    assert client.batches.retrieve(batch.id).status == "cancelled"
    assert not pg_server.ctx.storage.exists(key) and row_count(pg_server, f.id) == 0


def test_a_deleted_file_a_running_batch_kept_is_removed_once_the_batch_ends(client, model_id, pg_server):
    f = upload(client, model_id)
    key = storage_key(pg_server, f.id)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for_batch(client, batch.id, {"in_progress"}, timeout=30)
    assert client.files.delete(f.id).deleted
    sweep(pg_server.ctx)
    assert pg_server.ctx.storage.exists(key)  # the batch still reads it
    client.batches.cancel(batch.id)
    wait_until(lambda: f.id in sweep(pg_server.ctx).removed_files or row_count(pg_server, f.id) == 0)
    assert not pg_server.ctx.storage.exists(key) and row_count(pg_server, f.id) == 0

"""The same code on SQLite and a local storage directory (the embedded default)."""

from __future__ import annotations

import io

import httpx
from openai import OpenAI

from batchapi.config import load_settings
from batchapi.db.migrate import upgrade
from tests.utils.batch_service import jsonl, live_server, new_key, request_line
from tests.utils.waiting import PAST_VALIDATION, wait_for_batch


def test_sdk_flow_on_sqlite(sqlite_server):
    client = OpenAI(base_url=sqlite_server.base_url + "/v1", api_key=new_key(sqlite_server, "lite"), max_retries=0)
    model = sqlite_server.app.state.model.id
    data = jsonl([request_line(f"r{i}", model) for i in range(6)])
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert client.files.content(f.id).content == data
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="2d")
    assert batch.expires_at - batch.created_at == 2 * 86400
    batch = wait_for_batch(client, batch.id, PAST_VALIDATION, timeout=30)
    assert (batch.status, batch.request_counts.total) == ("in_progress", 6)
    assert [b.id for b in client.batches.list(limit=1)] == [batch.id]
    assert client.batches.cancel(batch.id).status == "cancelling"
    assert (sqlite_server.ctx.settings.data_dir / "storage" / "files" / f.id).is_file()
    bad = client.files.create(file=("bad.jsonl", io.BytesIO(b"\xff\n")), purpose="batch")
    failed = client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_for_batch(client, failed.id, PAST_VALIDATION, timeout=30)
    assert [(e.code, e.line) for e in failed.errors.data] == [("invalid_encoding", 1)]


def test_auth_off_uses_one_default_project(tmp_path, tiny_llama_dir):
    settings = load_settings(data_dir=tmp_path, model=str(tiny_llama_dir), auth_required=False)
    upgrade(settings)
    with live_server(settings) as server, httpx.Client(base_url=server.base_url) as http:
        response = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")})
        assert response.status_code == 200
        assert [f["id"] for f in http.get("/v1/files").json()["data"]] == [response.json()["id"]]


def test_a_batch_left_validating_is_picked_up_at_start_up(tmp_path, tiny_llama_dir):
    from sqlalchemy import update

    from batchapi.batches.files import upload_file
    from batchapi.batches.service import create_batch
    from batchapi.context import open_context
    from batchapi.db.models import Batch
    from batchapi.db.projects import get_or_create_project
    from batchapi.db.session import session_scope
    from batchapi.models.registry import served_model_id

    settings = load_settings(data_dir=tmp_path, model=str(tiny_llama_dir), auth_required=False)
    upgrade(settings)
    ctx = open_context(settings)  # a process that dies right after creating the batch
    with session_scope(ctx.sessions) as session:
        project = get_or_create_project(session, "default").id
    f = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(jsonl([request_line("a", served_model_id(settings))])))
    bid = create_batch(ctx, project, f.id, "/v1/chat/completions", "24h").id
    with session_scope(ctx.sessions) as session:  # its validation lease has run out
        session.execute(update(Batch).where(Batch.id == bid).values(validation_lease_expires_at=1))
    ctx.close()
    with live_server(settings) as server, httpx.Client(base_url=server.base_url) as http:
        batch = wait_for_batch(http, bid, PAST_VALIDATION, timeout=30)
    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 1

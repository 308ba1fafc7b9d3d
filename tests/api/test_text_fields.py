"""Text that has no UTF-8 form (a lone UTF-16 surrogate, which JSON lets through as an escape)
is refused with a 400 before anything is stored, wherever it enters (docs/API.md metadata)."""

from __future__ import annotations

import io

import httpx
import pytest
from sqlalchemy import func, select

from batchapi.batches.files import upload_file
from batchapi.db.models import File
from batchapi.errors import InvalidRequest
from tests.utils.batch_service import CHAT, jsonl, new_key, request_line


@pytest.fixture
def http(pg_server, request):
    key = new_key(pg_server, f"text-{request.node.name}")
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        yield client


@pytest.fixture
def file_id(http, model_id) -> str:
    lines = jsonl([request_line("a", model_id)])
    return http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", io.BytesIO(lines))}).json()["id"]


def post_raw(http, body: str) -> httpx.Response:
    """``body`` as written, escapes and all (a client's JSON encoder would refuse a lone surrogate)."""
    return http.post("/v1/batches", content=body.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(("fields", "param"), [
    ('"metadata": {"note": "x\\ud800"}', "metadata"),
    ('"metadata": {"\\udc00": "v"}', "metadata"),
    ('"metadata": {"ok": "\\ud83d\\ude00", "bad": "\\ude00\\ud83d"}', "metadata"),
])
def test_a_lone_surrogate_in_metadata_is_a_400_and_no_batch(http, file_id, fields, param):
    response = post_raw(http, f'{{"input_file_id": "{file_id}", "endpoint": "{CHAT}", "completion_window": "24h", {fields}}}')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "invalid_encoding", "invalid_request_error")
    assert "lone UTF-16 surrogate" in error["message"]
    listed = http.get("/v1/batches")
    assert listed.status_code == 200 and listed.json()["data"] == []


def test_a_lone_surrogate_in_the_input_file_id_is_a_400(http, file_id):
    response = post_raw(http, f'{{"input_file_id": "{file_id}\\ud800", "endpoint": "{CHAT}", "completion_window": "24h"}}')
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input_file_id"
    assert http.get("/v1/batches").json()["data"] == []


def test_a_surrogate_pair_in_metadata_is_kept(http, file_id):
    response = post_raw(http, f'{{"input_file_id": "{file_id}", "endpoint": "{CHAT}", "completion_window": "24h", '
                              '"metadata": {"emoji": "\\ud83d\\ude00"}}')
    assert response.status_code == 200, response.text
    listed = http.get("/v1/batches").json()["data"]
    assert [b["metadata"] for b in listed] == [{"emoji": "\U0001f600"}]


def test_a_file_name_that_is_not_utf8_is_stored_readable(http):
    body = (b"--xx\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\xed\xa0\x80.jsonl\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n{}\r\n--xx--\r\n")
    response = http.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=xx"})
    assert response.status_code == 200, response.text
    listed = http.get("/v1/files")
    assert listed.status_code == 200
    assert [f["filename"] for f in listed.json()["data"]] == ["a\ufffd\ufffd\ufffd.jsonl"]


def test_the_files_service_refuses_a_name_with_a_lone_surrogate(pg_server):
    ctx = pg_server.ctx
    with ctx.sessions() as session:
        before = session.scalar(select(func.count()).select_from(File))
    with pytest.raises(InvalidRequest) as raised:
        upload_file(ctx, "proj_text_fields", "a\ud800.jsonl", "batch", io.BytesIO(b"{}\n"))
    assert (raised.value.param, raised.value.code) == ("file", "invalid_encoding")
    with ctx.sessions() as session:
        assert session.scalar(select(func.count()).select_from(File)) == before

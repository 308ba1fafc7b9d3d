"""Malformed requests get a 4xx in the OpenAI error shape, never a 5xx."""

from __future__ import annotations

import io

import httpx
import pytest

from tests.utils.batch_service import jsonl, request_line

CHAT = "/v1/chat/completions"
GOOD = {"input_file_id": "FILE", "endpoint": CHAT, "completion_window": "24h"}

CASES = [
    # files
    ("POST", "/v1/files", {"data": {"purpose": "batch"}}, 400),
    ("POST", "/v1/files", {"files": {"file": ("a.jsonl", b"{}")}}, 400),
    ("POST", "/v1/files", {"data": {"purpose": "fine-tune"}, "files": {"file": ("a.jsonl", b"{}")}}, 400),
    ("POST", "/v1/files", {"data": {"purpose": "batch"}, "files": {"file": ("", b"{}")}}, 400),
    ("POST", "/v1/files", {"json": {"file": "abc", "purpose": "batch"}}, 400),
    ("POST", "/v1/files", {"content": b"--xx\r\ngarbage", "headers": {"Content-Type": "multipart/form-data; boundary=xx"}}, 400),
    ("GET", "/v1/files?limit=0", {}, 400),
    ("GET", "/v1/files?limit=abc", {}, 400),
    ("GET", "/v1/files?order=sideways", {}, 400),
    ("GET", "/v1/files?after=file-nope", {}, 404),
    ("GET", "/v1/files/file-nope", {}, 404),
    ("GET", "/v1/files/file-nope/content", {}, 404),
    ("DELETE", "/v1/files/file-nope", {}, 404),
    # batches
    ("POST", "/v1/batches", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400),
    ("POST", "/v1/batches", {"json": ["a", "b"]}, 400),
    ("POST", "/v1/batches", {"json": {}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "endpoint": "/v1/audio/speech"}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "endpoint": 5}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "completion_window": "forever"}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "completion_window": "30m"}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "completion_window": "8d"}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "metadata": {f"k{i}": "v" for i in range(17)}}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "metadata": {"k": "v" * 513}}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "metadata": {"k" * 65: "v"}}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "metadata": {"k": 1}}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "metadata": "x"}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "input_file_id": "file-nope"}}, 404),
    ("POST", "/v1/batches", {"json": GOOD, "headers": {"Idempotency-Key": "k" * 300}}, 400),
    ("GET", "/v1/batches?limit=0", {}, 400),
    ("GET", "/v1/batches?limit=101", {}, 400),
    ("GET", "/v1/batches?limit=many", {}, 400),
    ("GET", "/v1/batches?after=batch_nope", {}, 404),
    ("GET", "/v1/batches/batch_nope", {}, 404),
    ("POST", "/v1/batches/batch_nope/cancel", {}, 404),
    ("GET", "/v1/batches/batch_nope/partial_results", {}, 404),
    ("GET", "/v1/batches/BATCH/partial_results?kind=everything", {}, 400),
    # NUL characters, which PostgreSQL cannot store
    ("GET", "/v1/files/file-%00x", {}, 400),
    ("GET", "/v1/batches/batch_%00", {}, 400),
    ("GET", "/v1/batches?after=b%00", {}, 400),
    ("GET", "/v1/files?purpose=%00", {}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "input_file_id": "file-\x00"}}, 400),
    ("POST", "/v1/batches", {"json": {**GOOD, "completion_window": "24h\x00"}}, 400),
    # models and the rest
    ("GET", "/v1/models/gpt-4o", {}, 404),
    ("GET", "/v1/nothing-here", {}, 404),
    ("PUT", "/v1/batches", {}, 405),
    ("DELETE", "/v1/batches/BATCH", {}, 405),
]


@pytest.fixture(scope="module")
def objects(pg_server, model_id_module):
    from tests.utils.batch_service import new_key

    key = new_key(pg_server, "malformed")
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
        fid = http.post("/v1/files", data={"purpose": "batch"},
                        files={"file": ("b.jsonl", io.BytesIO(jsonl([request_line("a", model_id_module)])))}).json()["id"]
        bid = http.post("/v1/batches", json={**GOOD, "input_file_id": fid}).json()["id"]
    return key, fid, bid


@pytest.fixture(scope="module")
def model_id_module(pg_server):
    return pg_server.app.state.model.id


@pytest.mark.parametrize("method,path,kwargs,status", CASES, ids=[f"{c[0]} {c[1]} #{i}" for i, c in enumerate(CASES)])
def test_malformed_requests_get_4xx(pg_server, objects, method, path, kwargs, status):
    key, fid, bid = objects
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("json"), dict) and kwargs["json"].get("input_file_id") == "FILE":
        kwargs["json"] = {**kwargs["json"], "input_file_id": fid}
    headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
    with httpx.Client(base_url=pg_server.base_url, headers=headers) as http:
        response = http.request(method, path.replace("BATCH", bid), **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == response.headers["x-request-id"]
    assert isinstance(error["message"], str) and error["message"]


def test_an_output_file_cannot_be_a_batch_input(pg_server, objects):
    from batchapi.batches.files import register_file
    from batchapi.db.models import ApiKey
    from batchapi.db.projects import hash_key
    from batchapi.db.session import session_scope

    key, _, _ = objects
    ctx = pg_server.ctx
    ctx.storage.put_chunks("outputs/x.jsonl", [b"{}\n"])
    with session_scope(ctx.sessions) as session:
        project_id = session.query(ApiKey).filter_by(key_hash=hash_key(key)).one().project_id
        fid = register_file(session, project_id, "out.jsonl", "batch_output", "outputs/x.jsonl", 3).id
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
        assert http.get(f"/v1/files/{fid}").json()["purpose"] == "batch_output"
        response = http.post("/v1/batches", json={**GOOD, "input_file_id": fid})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input_file_id"

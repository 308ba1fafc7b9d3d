"""Missing or wrong keys get 401 everywhere; another project's objects are 404s."""

from __future__ import annotations

import io

import httpx
import pytest

from batchapi.db.projects import list_keys, revoke_key
from tests.utils.batch_service import jsonl, new_key, request_line
from tests.utils.waiting import PAST_VALIDATION, wait_for_batch, wait_until

ENDPOINTS = [
    ("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content"),
    ("DELETE", "/v1/files/file-x"), ("POST", "/v1/batches"), ("GET", "/v1/batches"), ("GET", "/v1/batches/batch_x"),
    ("POST", "/v1/batches/batch_x/cancel"), ("GET", "/v1/batches/batch_x/partial_results"), ("GET", "/v1/models"),
    ("GET", "/v1/models/tiny-llama"),
]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-batch-wrong"}, {"Authorization": "Basic abc"},
                                     {"Authorization": "Bearer"}], ids=["missing", "wrong", "basic", "empty"])
def test_every_endpoint_needs_a_valid_key(pg_server, headers):
    with httpx.Client(base_url=pg_server.base_url, headers=headers) as http:
        for method, path in ENDPOINTS:
            response = http.request(method, path)
            assert response.status_code == 401, (method, path)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["code"] in ("invalid_api_key", "missing_api_key")
            assert "wrong" not in error["message"] or "sk-batch…" in error["message"]


def test_a_revoked_key_gets_401(pg_server):
    key = new_key(pg_server, "revoked-key-project")
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
        assert http.get("/v1/files").status_code == 200
        [info] = list_keys(pg_server.ctx.settings, "revoked-key-project")
        assert revoke_key(pg_server.ctx.settings, info.id)
        cache = pg_server.app.state.key_cache  # a known key is cached this long after its last lookup
        wait_until(lambda: cache.get(key) is None, pg_server.ctx.settings.auth_cache_seconds,
                   message="the key's cache entry to run out")
        response = http.get("/v1/files")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {"error": {"message": f"Incorrect API key provided: {key[:8]}….",
                                         "type": "invalid_request_error", "param": None, "code": "invalid_api_key",
                                         "request_id": response.headers["x-request-id"]}}


def test_health_needs_no_key(pg_server):
    response = httpx.get(pg_server.base_url + "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok", "storage": "ok"}


def test_another_projects_objects_are_invisible(pg_server, model_id):
    mine = httpx.Client(base_url=pg_server.base_url,
                        headers={"Authorization": f"Bearer {new_key(pg_server, 'owner-project')}"})
    theirs = httpx.Client(base_url=pg_server.base_url,
                          headers={"Authorization": f"Bearer {new_key(pg_server, 'other-project')}"})
    with mine, theirs:
        upload = mine.post("/v1/files", data={"purpose": "batch"},
                           files={"file": ("b.jsonl", io.BytesIO(jsonl([request_line("a", model_id)])))})
        fid = upload.json()["id"]
        bid = mine.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}).json()["id"]
        wait_for_batch(mine, bid, PAST_VALIDATION, timeout=30)
        for method, path in [("GET", f"/v1/files/{fid}"), ("GET", f"/v1/files/{fid}/content"),
                             ("DELETE", f"/v1/files/{fid}"), ("GET", f"/v1/batches/{bid}"),
                             ("POST", f"/v1/batches/{bid}/cancel"), ("GET", f"/v1/batches/{bid}/partial_results"),
                             ("GET", f"/v1/batches?after={bid}"), ("GET", f"/v1/files?after={fid}")]:
            response = theirs.request(method, path)
            assert response.status_code == 404, (method, path)
            assert response.json()["error"]["type"] == "invalid_request_error"
        # their own batch from my file: the file does not exist for them
        response = theirs.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"})
        assert response.status_code == 404
        assert theirs.get("/v1/batches").json()["data"] == []
        assert theirs.get("/v1/files").json()["data"] == []
        assert mine.get(f"/v1/batches/{bid}").status_code == 200

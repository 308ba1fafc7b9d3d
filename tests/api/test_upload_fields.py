"""``POST /v1/uploads`` checks its fields as ``POST /v1/files`` does: no unknown fields, ``bytes`` an
integer (not "10" or true), a file name without control characters and of at most 512 characters,
a known purpose and a MIME type; each refusal a 400 in OpenAI's error shape naming the field."""

from __future__ import annotations

import io

import httpx
import pytest
from openai import BadRequestError, OpenAI

BASE = {"bytes": 10, "filename": "f.jsonl", "mime_type": "text/jsonl", "purpose": "batch"}


@pytest.fixture
def http(pg_server, api_key):
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {api_key}"}) as client:
        yield client


@pytest.mark.parametrize("change,param,code", [
    ({"frobnicate": 1}, "frobnicate", "extra_forbidden"),
    ({"bytes": "10"}, "bytes", "int_type"),
    ({"bytes": True}, "bytes", "int_type"),
    ({"bytes": 10.0}, "bytes", "int_type"),
    ({"filename": 7}, "filename", "string_type"),
    ({"filename": "a\x00b.jsonl"}, "filename", "invalid_request"),
    ({"filename": "a\nb.jsonl"}, "filename", "invalid_request"),
    ({"filename": "x" * 10_000}, "filename", "invalid_request"),
    ({"purpose": "fine-tune"}, "purpose", "invalid_request"),
    ({"purpose": None}, "purpose", "string_type"),
    ({"mime_type": "jsonl"}, "mime_type", "invalid_request"),
    ({"mime_type": "text/jsonl\x00"}, "mime_type", "invalid_request"),
])
def test_a_bad_field_is_refused_by_name(http, change, param, code):
    response = http.post("/v1/uploads", json={**BASE, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert param in error["message"] or error["message"].startswith(("the file name", "'fine-tune'"))


def test_good_fields_still_make_an_upload(http):
    for change in ({}, {"filename": "x" * 512, "mime_type": "application/jsonl; charset=utf-8"}):
        response = http.post("/v1/uploads", json={**BASE, **change})
        assert response.status_code == 200, response.text
        assert response.json()["filename"] == {**BASE, **change}["filename"]


def test_files_refuses_the_same_names(http, pg_server, api_key):
    sdk = OpenAI(base_url=pg_server.base_url + "/v1", api_key=api_key, max_retries=0)
    with pytest.raises(BadRequestError) as refused:
        sdk.files.create(file=("x" * 513, io.BytesIO(b"{}\n")), purpose="batch")
    assert refused.value.response.json()["error"]["param"] == "file"
    for name in (b"a\x00b.jsonl", b"a\tb.jsonl"):  # as sent raw: the SDK would percent-encode them
        body = (b"--xx\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                b"--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name + b"\"\r\n"
                b"Content-Type: application/octet-stream\r\n\r\n{}\r\n--xx--\r\n")
        response = http.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=xx"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "file"

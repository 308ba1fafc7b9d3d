"""``POST /v1/files`` refuses before it reads: a missing or wrong key and a declared size over the
limit are answered before the body, a chunked body past the limit as soon as it passes, and the
file streams into storage without a temporary file. What the server let the client send before it
answered is measured on a raw socket (the socket's own buffers included)."""

from __future__ import annotations

import itertools
import tempfile

import httpx
import pytest
from sqlalchemy import select

from batchapi.api.limits import MAX_JSON_BODY_BYTES
from batchapi.api.multipart import FORM_OVERHEAD_BYTES
from batchapi.db.migrate import upgrade
from batchapi.db.models import File
from batchapi.storage.s3 import S3Storage
from tests.api.raw_http import chunked, request_head, send_until_answered
from tests.utils.batch_service import (
    jsonl,
    live_server,
    new_key,
    pg_live_server,
    request_line,
    service_settings,
)

BOUNDARY = "test-boundary-1234"
CHUNK = b"x" * (1 << 16)
LIMIT = 1 << 20  # the small servers' file limit
# what the socket buffers on both ends and uvicorn's read-ahead (64 KiB) hold before the app answers
READ_AHEAD = 4 << 20


def form_start(purpose: str = "batch", name: str = "big.jsonl") -> bytes:
    return (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode()


def form_end() -> bytes:
    return f"\r\n--{BOUNDARY}--\r\n".encode()


def endless_form() -> itertools.chain:
    return itertools.chain([form_start()], itertools.repeat(CHUNK))


def upload_head(key: str | None, length: int | None) -> bytes:
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    headers.update({"Content-Length": str(length)} if length is not None else {"Transfer-Encoding": "chunked"})
    return request_head("POST", "/v1/files", headers)


def uploaded(server) -> list[str]:
    """Every uploaded object, open multipart upload and temp file of the server's storage."""
    storage = server.ctx.storage
    if isinstance(storage, S3Storage):
        pages = storage.client.get_paginator("list_objects_v2").paginate(
            Bucket=storage.bucket, Prefix=storage.prefix + "files/")
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        open_uploads = storage.client.list_multipart_uploads(Bucket=storage.bucket, Prefix=storage.prefix)
        return sorted(keys + [f"multipart:{u['Key']}" for u in open_uploads.get("Uploads", [])])
    return sorted(str(p.relative_to(storage.root)) for p in storage.root.rglob("*") if p.is_file())


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch):
    """The process's temp dir (the server runs in this process) in a folder of the test's own."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


@pytest.fixture(scope="module")
def small_servers(tmp_path_factory, s3, tiny_llama_dir):
    """A server with a 1 MiB file limit on PostgreSQL (a database of its own) and S3, and one on
    SQLite and a directory."""
    lite = service_settings(tmp_path_factory.mktemp("small-lite"), tiny_llama_dir, max_file_bytes=LIMIT)
    upgrade(lite)
    with pg_live_server(tmp_path_factory.mktemp("small-pg"), tiny_llama_dir, s3, max_file_bytes=LIMIT) as pg_server, \
            live_server(lite) as lite_server:
        yield {"postgresql+s3": pg_server, "sqlite+local": lite_server}


@pytest.fixture(params=["postgresql+s3", "sqlite+local"])
def small_server(request, small_servers):
    return small_servers[request.param]


def assert_refused(answer, status: int, code: str) -> None:
    assert answer.status == status, answer.body
    assert set(answer.json()["error"]) == {"message", "type", "param", "code", "request_id"}
    assert answer.json()["error"]["code"] == code
    assert answer.headers["connection"] == "close"


@pytest.mark.parametrize("length", [150_000_000, None], ids=["content-length", "chunked"])
@pytest.mark.parametrize("key,code", [(None, "missing_api_key"), ("sk-not-a-key", "invalid_api_key")],
                         ids=["no-key", "wrong-key"])
def test_an_unauthenticated_upload_is_refused_before_its_body_is_read(pg_server, own_tempdir, key, code, length):
    before = uploaded(pg_server)
    body = endless_form() if length is not None else chunked(endless_form())
    answer = send_until_answered(pg_server.base_url, upload_head(key, length), body)
    assert_refused(answer, 401, code)
    assert answer.sent < READ_AHEAD, answer.sent
    print(f"401 ({'chunked' if length is None else 'content-length'}): {answer.sent} body bytes taken, "
          f"answered in {answer.seconds:.3f} s")
    assert uploaded(pg_server) == before
    assert list(own_tempdir.iterdir()) == []


def test_a_declared_size_over_the_limit_is_refused_before_the_body_is_read(pg_server, api_key, own_tempdir):
    limit = pg_server.ctx.settings.max_upload_bytes
    assert limit == pg_server.ctx.settings.max_file_bytes == 200 * 1024 * 1024  # one limit by default
    before = uploaded(pg_server)
    answer = send_until_answered(pg_server.base_url, upload_head(api_key, limit + FORM_OVERHEAD_BYTES + 1),
                                 endless_form())
    assert_refused(answer, 413, "request_too_large")
    assert answer.sent < READ_AHEAD, answer.sent
    print(f"413 (content-length): {answer.sent} body bytes taken, answered in {answer.seconds:.3f} s")
    assert uploaded(pg_server) == before
    assert list(own_tempdir.iterdir()) == []


def test_a_chunked_upload_is_refused_as_it_passes_the_limit_and_nothing_is_kept(small_server, own_tempdir):
    key = new_key(small_server, "chunked-too-large")
    before = uploaded(small_server)
    big_before = big_files(small_server)  # the database is shared with other tests' servers
    answer = send_until_answered(small_server.base_url, upload_head(key, None), chunked(endless_form()))
    # the form's count of the file, or the body's (the limit plus the form's overhead) where one
    # read carried the body past both at once
    assert answer.json()["error"]["code"] in ("file_too_large", "request_too_large")
    assert_refused(answer, 413, answer.json()["error"]["code"])
    assert LIMIT < answer.sent < LIMIT + READ_AHEAD, answer.sent
    print(f"413 (chunked): {answer.sent} body bytes taken for a limit of {LIMIT}, "
          f"answered in {answer.seconds:.3f} s")
    assert uploaded(small_server) == before
    assert list(own_tempdir.iterdir()) == []
    assert big_files(small_server) == big_before


def big_files(server) -> set[str]:
    with server.ctx.sessions() as session:
        return set(session.scalars(select(File.id).where(File.bytes > LIMIT)))


def multipart(parts: list[tuple[str, bytes, str | None]]) -> bytes:
    """A form of (name, value, filename) parts in the order given."""
    out = []
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out.append(f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n")
    return b"".join(out) + f"--{BOUNDARY}--\r\n".encode()


def post_form(server, key: str, body: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    return httpx.post(server.base_url + "/v1/files", content=body, headers=headers, timeout=60)


def test_a_file_of_exactly_the_limit_is_kept_one_byte_more_is_refused(small_server):
    key = new_key(small_server, "limit-edge")
    before = uploaded(small_server)
    response = post_form(small_server, key, multipart([("purpose", b"batch", None), ("file", b"y" * LIMIT, "a.jsonl")]))
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == LIMIT
    assert len(uploaded(small_server)) == len(before) + 1

    before = uploaded(small_server)
    response = post_form(small_server, key, multipart([("purpose", b"batch", None),
                                                       ("file", b"y" * (LIMIT + 1), "a.jsonl")]))
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "file_too_large"
    assert uploaded(small_server) == before


def test_the_purpose_may_follow_the_file(pg_server, api_key, model_id):
    data = jsonl([request_line("a", model_id)])
    response = post_form(pg_server, api_key, multipart([("file", data, "late.jsonl"), ("purpose", b"batch", None)]))
    assert response.status_code == 200, response.text
    assert (response.json()["filename"], response.json()["bytes"]) == ("late.jsonl", len(data))
    content = httpx.get(f"{pg_server.base_url}/v1/files/{response.json()['id']}/content",
                        headers={"Authorization": f"Bearer {api_key}"})
    assert content.content == data


@pytest.mark.parametrize("parts,param", [
    ([("file", b"{}\n", "a.jsonl"), ("purpose", b"fine-tune", None)], "purpose"),
    ([("file", b"{}\n", "a.jsonl")], "purpose"),
    ([("purpose", b"batch", None)], "file"),
    ([("purpose", b"batch", None), ("file", b"{}\n", "a.jsonl"), ("file", b"{}\n", "b.jsonl")], "file"),
    ([("purpose", b"batch" * 300, None), ("file", b"{}\n", "a.jsonl")], "purpose"),
    ([(f"f{i}", b"v", None) for i in range(9)], None),
], ids=["bad-purpose-after-file", "no-purpose", "no-file", "two-files", "long-field", "many-fields"])
def test_a_bad_form_is_refused_and_nothing_is_kept(pg_server, api_key, parts, param):
    before = uploaded(pg_server)
    response = post_form(pg_server, api_key, multipart(parts))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert uploaded(pg_server) == before


def test_a_form_cut_short_is_refused(pg_server, api_key):
    body = multipart([("purpose", b"batch", None), ("file", b"{}\n" * 1000, "a.jsonl")])
    response = post_form(pg_server, api_key, body[:-len(form_end()) - 100])
    assert response.status_code == 400, response.text
    assert "closing boundary" in response.json()["error"]["message"]


@pytest.mark.parametrize("length", [MAX_JSON_BODY_BYTES + 1, None], ids=["content-length", "chunked"])
def test_a_json_body_over_its_limit_is_refused(pg_server, api_key, length):
    head = request_head("POST", "/v1/batches", {
        "Authorization": f"Bearer {api_key}", "Content-Type": "application/json",
        **({"Content-Length": str(length)} if length else {"Transfer-Encoding": "chunked"})})
    endless = itertools.chain([b'{"metadata": {"k": "'], itertools.repeat(CHUNK))
    answer = send_until_answered(pg_server.base_url, head, endless if length else chunked(endless))
    assert_refused(answer, 413, "request_too_large")
    assert answer.sent < MAX_JSON_BODY_BYTES + READ_AHEAD


def test_a_message_batch_over_its_limit_is_refused_in_anthropics_shape(pg_server, api_key):
    from batchapi.batches.messages import MAX_BODY_BYTES

    head = request_head("POST", "/v1/messages/batches", {
        "x-api-key": api_key, "anthropic-version": "2023-06-01", "Content-Type": "application/json",
        "Content-Length": str(MAX_BODY_BYTES + 1)})
    answer = send_until_answered(pg_server.base_url, head, itertools.chain([b'{"requests": ['], itertools.repeat(CHUNK)))
    assert answer.status == 413 and answer.sent < READ_AHEAD, (answer.status, answer.sent)
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large", body
    assert str(MAX_BODY_BYTES) in body["error"]["message"]

"""OpenAI's Uploads API with the openai SDK against live servers (PostgreSQL + SeaweedFS S3, and
SQLite + a local directory): ``upload_file_chunked`` gives a byte-identical File that a batch can
use; parts may come in any order and ``part_ids`` decides the file's; every refusal is in
OpenAI's error shape."""

from __future__ import annotations

import hashlib
import os

import httpx
import openai
import pytest
from openai import OpenAI
from sqlalchemy import select, update

from batchapi.api.multipart import FORM_OVERHEAD_BYTES
from batchapi.batches.uploads import MAX_PART_BYTES, expire_uploads
from batchapi.db.models import Upload, UploadPart
from batchapi.db.session import session_scope
from batchapi.storage.s3 import MIN_COPY_PART, S3Storage
from tests.api.raw_http import chunked, request_head, send_until_answered
from tests.utils.batch_service import jsonl, new_key, request_line
from tests.utils.waiting import PAST_VALIDATION, wait_for_batch


@pytest.fixture(params=["postgresql+s3", "sqlite+local"])
def server(request):
    return request.getfixturevalue("pg_server" if request.param == "postgresql+s3" else "sqlite_server")


@pytest.fixture
def key(server, request) -> str:
    return new_key(server, f"uploads-{request.node.name}")


@pytest.fixture
def sdk(server, key) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def batch_file(model_id: str, at_least: int) -> bytes:
    """A valid batch input file of at least ``at_least`` bytes."""
    lines, size = [], 0
    while size < at_least:
        line = request_line(f"r{len(lines)}", model_id, "x" * 900, max_tokens=4)
        lines.append(line)
        size += len(jsonl([line]))
    return jsonl(lines)


def objects_under(storage, prefix: str) -> list[str]:
    if isinstance(storage, S3Storage):
        listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=storage.prefix + prefix)
        return [o["Key"] for o in listed.get("Contents", [])]
    return [str(p) for p in (storage.root / prefix).rglob("*") if p.is_file()]


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(body)
    return body


def test_a_chunked_upload_is_byte_identical_and_a_batch_input(server, sdk, tmp_path):
    model_id = server.app.state.model.id
    data = batch_file(model_id, 2_500_000)
    source = tmp_path / "requests.jsonl"
    source.write_bytes(data)
    upload = sdk.uploads.upload_file_chunked(file=source, mime_type="text/jsonl", purpose="batch",
                                             part_size=1_000_000, md5=hashlib.md5(data).hexdigest())
    assert (upload.object, upload.status, upload.bytes, upload.filename) == ("upload", "completed", len(data),
                                                                           "requests.jsonl")
    assert upload.expires_at == upload.created_at + 3600
    f = upload.file
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(data), "requests.jsonl")
    assert f.expires_at == f.created_at + 30 * 86400  # a batch input file's default, as OpenAI's
    assert sdk.files.retrieve(f.id).bytes == len(data)
    assert sdk.files.content(f.id).content == data

    with server.ctx.sessions() as session:  # the parts are gone once the file is made
        assert session.scalars(select(UploadPart).where(UploadPart.upload_id == upload.id)).all() == []
    assert objects_under(server.ctx.storage, f"uploads/{upload.id}/") == []

    batch = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_for_batch(sdk, batch.id, PAST_VALIDATION, timeout=30)
    assert batch.status == "in_progress", batch.errors
    assert batch.request_counts.total == data.count(b"\n")  # left in_progress: no worker runs this server's shards


def test_parts_in_any_order_make_the_file_part_ids_say(server, sdk):
    big = os.urandom(MIN_COPY_PART + 1000)  # on S3, parts this large are composed server-side
    small = b"tail-of-the-file"
    upload = sdk.uploads.create(bytes=len(big) + len(small), filename="data.bin", mime_type="application/octet-stream",
                                purpose="batch", expires_after={"anchor": "created_at", "seconds": 7200})
    assert upload.status == "pending"
    second = sdk.uploads.parts.create(upload.id, data=small)  # sent first, put last
    first = sdk.uploads.parts.create(upload.id, data=big)
    assert (first.object, first.upload_id) == ("upload.part", upload.id)
    done = sdk.uploads.complete(upload.id, part_ids=[first.id, second.id])
    assert done.status == "completed" and done.file.expires_at == done.file.created_at + 7200
    assert sdk.files.content(done.file.id).content == big + small

    # small parts (under S3's 5 MiB part minimum) in another order stream into one object instead
    upload = sdk.uploads.create(bytes=9, filename="abc.txt", mime_type="text/plain", purpose="batch")
    ids = {chunk: sdk.uploads.parts.create(upload.id, data=chunk).id for chunk in (b"aaa", b"bbb", b"ccc")}
    done = sdk.uploads.complete(upload.id, part_ids=[ids[b"ccc"], ids[b"aaa"], ids[b"bbb"]])
    assert sdk.files.content(done.file.id).content == b"cccaaabbb"


def test_part_ids_must_name_each_part_once_and_add_up(server, sdk):
    upload = sdk.uploads.create(bytes=6, filename="x.jsonl", mime_type="text/jsonl", purpose="batch")
    a = sdk.uploads.parts.create(upload.id, data=b"abc").id
    b = sdk.uploads.parts.create(upload.id, data=b"def").id
    other = sdk.uploads.create(bytes=3, filename="y.jsonl", mime_type="text/jsonl", purpose="batch")
    foreign = sdk.uploads.parts.create(other.id, data=b"xyz").id
    for part_ids, code in (([a], "upload_size_mismatch"), ([a, a], None), ([a, foreign], None), ([], None),
                           ([a, b, "part_nope"], None)):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.uploads.complete(upload.id, part_ids=part_ids)
        assert error_of(refused.value)["param"] == "part_ids", part_ids
        if code:
            assert error_of(refused.value)["code"] == code
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.uploads.complete(upload.id, part_ids=[a, b], md5="0" * 32)
    assert (error_of(refused.value)["param"], error_of(refused.value)["code"]) == ("md5", "md5_mismatch")
    with pytest.raises(openai.BadRequestError) as refused:  # more bytes than the Upload was made for
        sdk.uploads.parts.create(upload.id, data=b"g")
    assert error_of(refused.value)["param"] == "data"
    assert sdk.uploads.complete(upload.id, part_ids=[b, a]).status == "completed"
    with pytest.raises(openai.BadRequestError) as refused:  # completed: no more parts, no second complete
        sdk.uploads.parts.create(upload.id, data=b"h")
    assert error_of(refused.value)["code"] == "upload_completed"
    with pytest.raises(openai.BadRequestError):
        sdk.uploads.complete(upload.id, part_ids=[b, a])
    with pytest.raises(openai.BadRequestError):
        sdk.uploads.cancel(upload.id)


def test_cancel_ends_an_upload_and_removes_its_parts(server, sdk):
    upload = sdk.uploads.create(bytes=4, filename="c.jsonl", mime_type="text/jsonl", purpose="batch")
    part = sdk.uploads.parts.create(upload.id, data=b"abcd")
    with server.ctx.sessions() as session:
        key = session.get(UploadPart, part.id).storage_key
    assert server.ctx.storage.exists(key)
    assert sdk.uploads.cancel(upload.id).status == "cancelled"
    assert not server.ctx.storage.exists(key)
    for call in (lambda: sdk.uploads.parts.create(upload.id, data=b"e"),
                 lambda: sdk.uploads.complete(upload.id, part_ids=[part.id])):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert error_of(refused.value)["code"] == "upload_cancelled"


def test_an_upload_not_completed_within_the_hour_expires(server, sdk):
    upload = sdk.uploads.create(bytes=4, filename="late.jsonl", mime_type="text/jsonl", purpose="batch")
    part = sdk.uploads.parts.create(upload.id, data=b"abcd")
    with session_scope(server.ctx.sessions) as session:  # an hour and a second later
        session.execute(update(Upload).where(Upload.id == upload.id).values(expires_at=Upload.created_at - 1))
        key = session.get(UploadPart, part.id).storage_key
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.uploads.complete(upload.id, part_ids=[part.id])
    assert (error_of(refused.value)["param"], error_of(refused.value)["code"]) == ("upload_id", "upload_expired")
    with pytest.raises(openai.BadRequestError):
        sdk.uploads.parts.create(upload.id, data=b"e")
    # the sweeper's upload step alone: a whole sweep of this shared server would also end other
    # tests' batches (minutes of error files for their big ones)
    assert upload.id in expire_uploads(server.ctx, lambda rows, what, act: [act(row) for row in rows])
    with server.ctx.sessions() as session:
        assert session.get(Upload, upload.id).status == "expired"
    assert not server.ctx.storage.exists(key)


def test_unknown_uploads_and_bad_creates_are_refused(server, sdk, key):
    with pytest.raises(openai.NotFoundError) as refused:
        sdk.uploads.parts.create("upload_nope", data=b"x")
    assert error_of(refused.value)["param"] == "upload_id"
    for call in (lambda: sdk.uploads.complete("upload_nope", part_ids=["part_x"]),
                 lambda: sdk.uploads.cancel("upload_nope")):
        with pytest.raises(openai.NotFoundError):
            call()
    other = OpenAI(base_url=server.base_url + "/v1", api_key=new_key(server, "uploads-someone-else"), max_retries=0)
    theirs = other.uploads.create(bytes=1, filename="t.jsonl", mime_type="text/jsonl", purpose="batch")
    with pytest.raises(openai.NotFoundError):  # another project's Upload looks the same as none
        sdk.uploads.cancel(theirs.id)
    base = dict(bytes=10, filename="f.jsonl", mime_type="text/jsonl", purpose="batch")
    for change, param in (({"bytes": 9 * 1024**3}, "bytes"), ({"bytes": 0}, "bytes"),
                          ({"bytes": 300 * 1024**2}, "bytes"), ({"purpose": "fine-tune"}, "purpose"),
                          ({"filename": ""}, "filename"), ({"mime_type": ""}, "mime_type"),
                          ({"expires_after": {"anchor": "created_at", "seconds": 60}}, "expires_after.seconds"),
                          ({"expires_after": {"anchor": "last_active_at", "seconds": 3600}}, "expires_after.anchor")):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.uploads.create(**{**base, **change})
        assert error_of(refused.value)["param"] == param, change


def test_a_part_over_64_mb_is_refused(pg_server, api_key):
    upload = OpenAI(base_url=pg_server.base_url + "/v1", api_key=api_key, max_retries=0).uploads.create(
        bytes=100 * 1024**2, filename="big.jsonl", mime_type="text/jsonl", purpose="batch")
    boundary = "part-boundary"
    start = (f'--{boundary}\r\nContent-Disposition: form-data; name="data"; filename="blob"\r\n'
             "Content-Type: application/octet-stream\r\n\r\n").encode()
    chunk = b"x" * (1 << 20)
    path = f"/v1/uploads/{upload.id}/parts"
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", "Authorization": f"Bearer {api_key}"}

    declared = request_head("POST", path, {**headers, "Content-Length": str(MAX_PART_BYTES + FORM_OVERHEAD_BYTES + 1)})
    answer = send_until_answered(pg_server.base_url, declared, iter([start, *[chunk] * 4]))
    assert answer.status == 413 and answer.json()["error"]["code"] == "request_too_large"

    endless = iter([start, *[chunk] * (MAX_PART_BYTES // len(chunk) + 2)])
    answer = send_until_answered(pg_server.base_url, request_head("POST", path, {**headers,
                                 "Transfer-Encoding": "chunked"}), chunked(endless))
    assert answer.status == 413, answer.body  # the part's limit or the body's, whichever trips first
    assert answer.json()["error"]["code"] in ("file_too_large", "request_too_large")
    with pg_server.ctx.sessions() as session:
        assert session.scalars(select(UploadPart).where(UploadPart.upload_id == upload.id)).all() == []
    response = httpx.post(pg_server.base_url + path, headers={"Authorization": f"Bearer {api_key}"},
                          files={"wrong": ("blob", b"abc")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "data"

"""Both storages behave the same: streamed writes, ranged streamed reads, overwrite, delete."""

from __future__ import annotations

import io

import pytest

from batchapi.errors import NotFound, StorageError
from batchapi.storage.s3 import MULTIPART_THRESHOLD, S3Storage


def test_round_trip_with_ranges(storage):
    data = bytes(range(256)) * 9000  # 2.3 MB, several read chunks
    assert storage.put_stream("files/a", io.BytesIO(data)) == len(data)
    assert storage.size("files/a") == len(data)
    assert storage.exists("files/a")
    assert b"".join(storage.iter_chunks("files/a")) == data
    assert b"".join(storage.iter_chunks("files/a", 1000, 1_500_000)) == data[1000:1_500_000]
    assert b"".join(storage.iter_chunks("files/a", 5, 5)) == b""
    assert b"".join(storage.iter_chunks("files/a", len(data) - 3)) == data[-3:]


def test_overwrite_and_delete(storage):
    storage.put_chunks("batches/b/shards/00000.output.jsonl", [b"one\n", b"two\n"])
    storage.put_chunks("batches/b/shards/00000.output.jsonl", [b"retry\n"])
    assert b"".join(storage.iter_chunks("batches/b/shards/00000.output.jsonl")) == b"retry\n"
    storage.delete("batches/b/shards/00000.output.jsonl")
    storage.delete("batches/b/shards/00000.output.jsonl")  # a missing key is fine
    assert not storage.exists("batches/b/shards/00000.output.jsonl")
    with pytest.raises(NotFound):
        storage.size("batches/b/shards/00000.output.jsonl")
    with pytest.raises(NotFound):
        list(storage.iter_chunks("nope"))


def test_check(storage):
    storage.check()


def test_s3_multipart_upload_streams_from_a_reader(s3):
    storage = S3Storage(s3.bucket, "multipart", s3.endpoint_url, s3.region,
                        s3.aws_access_key_id, s3.aws_secret_access_key)
    part = b"0123456789abcdef" * (1 << 16)  # 1 MiB
    count = MULTIPART_THRESHOLD // len(part) + 3
    parts = []
    storage.client.meta.events.register("before-call.s3.UploadPart", lambda **kw: parts.append(1))
    assert storage.put_chunks("big", (part for _ in range(count))) == count * len(part)
    assert len(parts) == 2  # one full part of MULTIPART_THRESHOLD and the rest
    assert sum(len(c) for c in storage.iter_chunks("big")) == count * len(part)


def test_s3_unreachable_bucket_fails_check(s3):
    storage = S3Storage("no-such-bucket-here", "", s3.endpoint_url, s3.region,
                        s3.aws_access_key_id, s3.aws_secret_access_key)
    with pytest.raises(StorageError):
        storage.check()

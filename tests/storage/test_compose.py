"""``Storage.compose``: an Upload's parts, in the order given, become one object; on S3 server-side
(a multipart upload of part copies) when the parts are large enough to be S3 parts, else streamed."""

from __future__ import annotations

import os

import pytest

from batchapi.errors import NotFound
from batchapi.storage.s3 import MIN_COPY_PART, S3Storage


def read(storage, key: str) -> bytes:
    return b"".join(storage.iter_chunks(key))


@pytest.mark.parametrize("sizes,copies", [([3, 1, 4], 0), ([10, MIN_COPY_PART + 7, MIN_COPY_PART], 3), ([5], 1),
                                          ([], 0)], ids=["small", "s3-part-sized", "one", "none"])
def test_compose_concatenates_in_the_order_given(storage, sizes, copies):
    parts = [os.urandom(size) for size in sizes]
    keys = [f"uploads/u/part_{i}" for i in range(len(parts))]
    for key, data in zip(keys, parts, strict=True):
        storage.put_chunks(key, [data])
    order = list(reversed(range(len(parts))))  # the 10-byte part last, where S3 takes a small part
    part_copies = []
    if isinstance(storage, S3Storage):
        storage.client.meta.events.register("before-call.s3.UploadPartCopy", lambda **_: part_copies.append(1))
    assert storage.compose("files/out", [keys[i] for i in order]) == sum(sizes)
    assert len(part_copies) == (copies if isinstance(storage, S3Storage) else 0)
    assert read(storage, "files/out") == b"".join(parts[i] for i in order)
    assert all(read(storage, key) == data for key, data in zip(keys, parts, strict=True))  # the parts stay


def test_a_missing_part_is_not_found_and_writes_nothing(storage):
    storage.put_chunks("uploads/u/a", [b"abc"])
    with pytest.raises(NotFound):
        storage.compose("files/out", ["uploads/u/a", "uploads/u/gone"])
    assert not storage.exists("files/out")

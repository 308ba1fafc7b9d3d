"""Object storage behind one small interface, with a local-directory and an S3 implementation.

Everything streams: uploads are read from a file object in chunks and downloads are yielded
in chunks (optionally a byte range), so a 200 MB file never sits in memory whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import BinaryIO, Protocol

from batchapi.config import Settings

CHUNK = 1 << 20


class Storage(Protocol):
    def put_stream(self, key: str, stream: BinaryIO) -> int:
        """Write everything ``stream.read()`` yields under ``key`` (replacing it); return the size."""

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int:
        """Like ``put_stream`` for an iterable of byte chunks."""

    def iter_chunks(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Yield the bytes ``[start, end)`` of ``key`` (``end`` None: to the end) in chunks."""

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    def check(self) -> None:
        """Raise ``StorageError`` unless the storage is reachable and writable."""


def make_storage(settings: Settings) -> Storage:
    url = settings.resolved_storage_url
    if url.startswith("s3://"):
        from batchapi.jobs.s3_storage import S3Storage

        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Storage(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=settings.s3_endpoint_url or None,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id or None,
            secret_access_key=settings.s3_secret_access_key or None,
        )
    from batchapi.jobs.local_storage import LocalStorage

    return LocalStorage(url[len("file://") :])


# fixed keys: a retried writer overwrites its own object, never appends to it


def file_key(file_id: str) -> str:
    return f"files/{file_id}"


def shard_output_key(batch_id: str, index: int) -> str:
    return f"batches/{batch_id}/shards/{index:05d}.output.jsonl"


def shard_error_key(batch_id: str, index: int) -> str:
    return f"batches/{batch_id}/shards/{index:05d}.error.jsonl"


class ChunkReader:
    """A read-only file object over an iterable of byte chunks. ``read(n)`` returns ``n`` bytes
    unless the chunks run out, as boto3's transfer manager expects of a stream."""

    def __init__(self, chunks: Iterable[bytes]):
        self._chunks = iter(chunks)
        self._pending = b""

    def read(self, size: int = -1) -> bytes:
        parts = [self._pending]
        have = len(self._pending)
        while size is None or size < 0 or have < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        if size is None or size < 0:
            self._pending = b""
            return data
        self._pending = data[size:]
        return data[:size]


class CountingReader:
    """Wraps a binary stream and counts the bytes read through it."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.count += len(data)
        return data

"""File-object adapters the stores and the upload path share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import BinaryIO

from batchapi.errors import InvalidRequest

CHUNK = 1 << 20  # bytes per read and per yielded chunk


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


class TooLarge(InvalidRequest):
    code = "file_too_large"


class LimitedReader:
    """Reads through to ``stream`` and raises ``TooLarge`` past ``limit`` bytes."""

    def __init__(self, stream: BinaryIO, limit: int):
        self._stream = stream
        self._left = limit + 1
        self._limit = limit

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(self._left if size is None or size < 0 else min(size, self._left))
        self._left -= len(data)
        if self._left <= 0:
            raise TooLarge(f"the file is larger than the upload limit of {self._limit} bytes", "file")
        return data

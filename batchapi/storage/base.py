"""Object storage behind one small interface, with a local-directory and an S3 implementation.

Everything streams: uploads are read from a file object in chunks and downloads are yielded
in chunks (optionally a byte range), so a 200 MB file never sits in memory whole. Object keys
are built in ``keys.py``; the stream adapters both stores share are in ``streams.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import BinaryIO, Protocol

from batchapi.config import Settings
from batchapi.errors import StorageError

log = logging.getLogger(__name__)


class Storage(Protocol):
    def put_stream(self, key: str, stream: BinaryIO) -> int:
        """Write everything ``stream.read()`` yields under ``key`` (replacing it); return the size."""

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int:
        """Like ``put_stream`` for an iterable of byte chunks."""

    def iter_chunks(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Yield the bytes ``[start, end)`` of ``key`` (``end`` None: to the end) in chunks."""

    def compose(self, key: str, sources: list[str]) -> int:
        """Write the concatenation of the objects ``sources``, in that order, under ``key``; return
        the size. The sources stay (an Upload's parts, deleted by the caller once it is recorded)."""

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    def check(self) -> None:
        """Raise ``StorageError`` unless the storage is reachable and writable."""

    def remove_partial(self, older_than: float | None = None) -> int:
        """Remove what writers killed mid-write left behind (a local ``.tmp-*`` file, an S3
        multipart upload) older than ``older_than`` seconds (None: the store's grace period, past
        any write still in progress); return how many went."""


def make_storage(settings: Settings) -> Storage:
    url = settings.resolved_storage_url
    if url.startswith("s3://"):
        from batchapi.storage.s3 import S3Storage

        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Storage(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=settings.s3_endpoint_url or None,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id or None,
            secret_access_key=settings.s3_secret_access_key or None,
        )
    from batchapi.storage.local import LocalStorage

    return LocalStorage(url[len("file://") :])


def discard(storage: Storage, keys: Iterable[str]) -> None:
    """Delete objects nothing reads any more, best effort: one that cannot be deleted now is
    logged and stays (it costs space, never a result)."""
    for key in keys:
        try:
            storage.delete(key)
        except (StorageError, OSError) as exc:
            log.warning("could not delete %s, which nothing reads: %s", key, exc)


def remove_partial_writes(storage: Storage) -> None:
    """``storage.remove_partial()`` from the sweep loop, where an unreachable store is only logged."""
    try:
        storage.remove_partial()
    except StorageError as exc:
        log.warning("could not look for partial writes in storage: %s", exc)

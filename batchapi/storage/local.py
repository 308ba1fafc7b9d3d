"""Storage in a local directory (the embedded default)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from batchapi.errors import NotFound, StorageError
from batchapi.storage.streams import CHUNK, ChunkReader

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
# a write in progress touches its temp file on every chunk; one untouched this long is dead
PARTIAL_GRACE_SECONDS = 3600


class LocalStorage:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        assert key and ".." not in key.split("/") and not key.startswith("/"), f"bad key {key!r}"
        return self.root / key

    def put_stream(self, key: str, stream: BinaryIO) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # write beside the target and rename, so readers never see half an object
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(stream, out, CHUNK)
                size = out.tell()
            os.replace(tmp, path)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, FileNotFoundError):  # remove_partial took a temp file left idle too long
                raise StorageError(f"write of {key!r} was interrupted: {exc}") from exc
            raise
        return size

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int:
        return self.put_stream(key, ChunkReader(chunks))

    def compose(self, key: str, sources: list[str]) -> int:
        return self.put_chunks(key, (chunk for source in sources for chunk in self.iter_chunks(source)))

    def iter_chunks(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        try:
            handle = open(self._path(key), "rb")
        except FileNotFoundError:
            raise NotFound(f"no object {key!r}") from None
        with handle:
            handle.seek(start)
            left = None if end is None else end - start
            while left is None or left > 0:
                data = handle.read(CHUNK if left is None else min(CHUNK, left))
                if not data:
                    return
                if left is not None:
                    left -= len(data)
                yield data

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"no object {key!r}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".health"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"storage directory {self.root} is not writable: {exc}") from exc

    def remove_partial(self, older_than: float | None = None) -> int:
        """The ``.tmp-*`` files of writes killed before their rename."""
        cutoff = time.time() - (PARTIAL_GRACE_SECONDS if older_than is None else older_than)
        removed = 0
        for path in self.root.rglob(TMP_PREFIX + "*"):
            try:
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # its writer finished or another sweep took it
                continue
        if removed:
            log.info("removed %d partial writes under %s", removed, self.root)
        return removed

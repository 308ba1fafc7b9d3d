"""Storage in a local directory (the embedded default)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from batchapi.errors import NotFound, StorageError
from batchapi.storage.streams import CHUNK, ChunkReader


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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(stream, out, CHUNK)
                size = out.tell()
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size

    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> int:
        return self.put_stream(key, ChunkReader(chunks))

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

"""The API process removes at start-up what writers killed mid-write left in its storage."""

from __future__ import annotations

import os
import time

from batchapi.db.migrate import upgrade
from batchapi.storage.local import PARTIAL_GRACE_SECONDS
from tests.utils.batch_service import live_server, service_settings
from tests.utils.waiting import wait_until


def test_start_up_removes_stale_temp_files_and_keeps_the_rest(tmp_path, tiny_llama_dir):
    settings = service_settings(tmp_path, tiny_llama_dir)
    upgrade(settings)
    files = tmp_path / "storage" / "files"
    files.mkdir(parents=True)
    stale, fresh, whole = files / ".tmp-stale", files / ".tmp-fresh", files / "file-whole"
    for path in (stale, fresh, whole):
        path.write_bytes(b"x" * 100)
    old = time.time() - PARTIAL_GRACE_SECONDS - 60
    for path in (stale, whole):
        os.utime(path, (old, old))
    with live_server(settings):
        wait_until(lambda: not stale.exists(), timeout=30)
    assert fresh.exists() and whole.exists()

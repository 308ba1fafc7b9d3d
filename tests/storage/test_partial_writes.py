"""A writer killed mid-write (kill -9) leaves a partial object behind: a ``.tmp-*`` file beside the
target in a local directory, an open multipart upload in S3. ``remove_partial`` takes those that are
past the grace period, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from batchapi.storage.local import PARTIAL_GRACE_SECONDS, LocalStorage
from batchapi.storage.s3 import MULTIPART_THRESHOLD, S3Storage
from tests.utils.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

# writes 1 MiB chunks through put_chunks, touches READY once `ready_after` bytes went in, then hangs
WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    {make_storage}
    ready, ready_after = Path(sys.argv[1]), int(sys.argv[2])

    def chunks():
        sent = 0
        while sent < ready_after:
            yield b"x" * (1 << 20)
            sent += 1 << 20
        ready.touch()
        time.sleep(3600)

    storage.put_chunks("files/file-killed", chunks())
""")


def kill_writer_midway(tmp_path: Path, make_storage: str, ready_after: int, started=None) -> None:
    """Run a writer in a child process and kill -9 it once it is mid-write."""
    ready = tmp_path / "ready"
    script = WRITER.format(make_storage=make_storage)
    child = subprocess.Popen([sys.executable, "-c", script, str(ready), str(ready_after)], cwd=ROOT)
    try:
        wait_until(lambda: ready.exists() and (started is None or started()), timeout=60)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def test_local_temp_file_of_a_killed_writer_is_removed_after_the_grace_period(tmp_path):
    store = LocalStorage(tmp_path / "store")
    store.put_chunks("files/file-kept", [b"whole\n"])
    make = f"from batchapi.storage.local import LocalStorage; storage = LocalStorage({str(store.root)!r})"
    kill_writer_midway(tmp_path, make, ready_after=3 << 20)

    [partial] = (store.root / "files").glob(".tmp-*")
    assert partial.stat().st_size >= 2 << 20  # what the writer had copied before it died
    assert store.remove_partial() == 0  # fresh: it could be a write still going on
    assert partial.exists()

    old = time.time() - PARTIAL_GRACE_SECONDS - 60
    os.utime(partial, (old, old))
    assert store.remove_partial() == 1
    assert not partial.exists()
    assert sorted(p.name for p in (store.root / "files").iterdir()) == ["file-kept"]
    assert not store.exists("files/file-killed")
    assert b"".join(store.iter_chunks("files/file-kept")) == b"whole\n"


def test_local_remove_partial_on_an_empty_or_missing_root(tmp_path):
    assert LocalStorage(tmp_path / "never-made").remove_partial(older_than=0) == 0


def test_s3_multipart_upload_of_a_killed_writer_is_aborted(tmp_path, s3):
    prefix = f"partial-{uuid.uuid4().hex[:8]}"
    store = S3Storage(s3.bucket, prefix, s3.endpoint_url, s3.region, s3.aws_access_key_id, s3.aws_secret_access_key)
    other = S3Storage(s3.bucket, prefix + "-other", s3.endpoint_url, s3.region,
                      s3.aws_access_key_id, s3.aws_secret_access_key)
    store.put_chunks("files/file-kept", [b"whole\n"])
    other_upload = other.client.create_multipart_upload(Bucket=s3.bucket, Key=f"{prefix}-other/files/x")

    def uploads() -> list[dict]:
        return store.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix + "/").get("Uploads", [])

    make = (f"from batchapi.storage.s3 import S3Storage; storage = S3Storage({s3.bucket!r}, {prefix!r}, "
            f"{s3.endpoint_url!r}, {s3.region!r}, {s3.aws_access_key_id!r}, {s3.aws_secret_access_key!r})")
    kill_writer_midway(tmp_path, make, ready_after=MULTIPART_THRESHOLD + (1 << 20), started=uploads)

    [upload] = uploads()
    assert upload["Key"] == f"{prefix}/files/file-killed"
    assert store.remove_partial() == 0  # started just now: it could still be running
    assert len(uploads()) == 1

    assert store.remove_partial(older_than=0) == 1
    assert uploads() == []
    assert not store.exists("files/file-killed")
    assert b"".join(store.iter_chunks("files/file-kept")) == b"whole\n"
    # another prefix's uploads are another service's business
    listed = other.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=f"{prefix}-other/")["Uploads"]
    assert [u["UploadId"] for u in listed] == [other_upload["UploadId"]]
    other.client.abort_multipart_upload(Bucket=s3.bucket, Key=f"{prefix}-other/files/x",
                                        UploadId=other_upload["UploadId"])

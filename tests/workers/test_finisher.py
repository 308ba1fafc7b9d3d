"""The finisher on PostgreSQL and S3, with a runner in this process: a stalled finisher cannot
replace the objects of the attempt that took its shard over, and a store that keeps failing
loses no finished request (the shard is left to be taken over, and runs only what is left)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select, update

from batchapi.batches import leases
from batchapi.batches.service import iter_partial_results
from batchapi.context import open_context
from batchapi.db.models import Batch, File, RequestResult, Shard
from batchapi.db.session import session_scope
from batchapi.errors import StorageError
from batchapi.storage import make_storage
from batchapi.storage.keys import shard_error_key, shard_output_key
from tests.utils.batch_service import jsonl, pg_live_server, wait_until
from tests.workers.helpers import lines_for

SETTINGS = dict(shard_size=4, sweep_seconds=0.5, worker_poll_seconds=0.2, max_num_seqs=4, max_num_batched_tokens=256,
                kv_cache_gb=0.05, device="cpu", auth_required=False, lease_seconds=30, heartbeat_seconds=1.0,
                result_flush_rows=1000, result_flush_seconds=60)  # the writer never writes unasked


class ShardObjects:
    """The real storage, with the writes of shard objects held at a gate or refused (a test trick)."""

    def __init__(self, storage):
        self.storage = storage
        self.gate: threading.Event | None = None  # set: writes wait for it
        self.entered = threading.Event()
        self.refuse = False
        self.written: list[str] = []

    def put_chunks(self, key, chunks):
        if "/shards/" in key:
            self.entered.set()
            if self.refuse:
                raise StorageError(f"the store refused {key}")
            if self.gate is not None:
                assert self.gate.wait(60)
        size = self.storage.put_chunks(key, chunks)
        self.written.append(key)
        return size

    def __getattr__(self, name):
        return getattr(self.storage, name)


@pytest.fixture(scope="module")
def server(tmp_path_factory, s3, tiny_llama_dir):
    with pg_live_server(tmp_path_factory.mktemp("finisher"), tiny_llama_dir, s3, "finisher",
                        **SETTINGS) as server:  # validation only: the test's runners run the shards
        yield server


def started_batch(server, prefix: str) -> tuple[str, str]:
    """A batch of one 4-request shard, in progress: (batch id, shard id)."""
    import httpx

    lines = lines_for(server.app.state.model.id, 4, prefix=prefix)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        uploaded = http.post("/v1/files", files={"file": ("b.jsonl", jsonl(lines))}, data={"purpose": "batch"})
        batch_id = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint":
                                                  "/v1/chat/completions", "completion_window": "24h"}).json()["id"]
    wait_until(lambda: status(server.ctx, batch_id) == "in_progress", timeout=60)
    with server.ctx.sessions() as session:
        return batch_id, session.scalar(select(Shard.id).where(Shard.batch_id == batch_id))


def status(ctx, batch_id: str) -> str:
    with ctx.sessions() as session:
        return session.get(Batch, batch_id).status


def runner(ctx, owner: str):
    from batchapi.engine import EngineFront
    from batchapi.workers.codec import Codec
    from batchapi.workers.engine_setup import engine_config_from
    from batchapi.workers.shard_runner import ShardRunner

    front = EngineFront(engine_config_from(ctx.settings)).start()
    return ShardRunner(ctx, front, Codec(front.tokenizer, "tiny-llama"), owner).start()


def output_of(ctx, batch_id: str) -> bytes:
    with ctx.sessions() as session:
        key = session.get(File, session.get(Batch, batch_id).output_file_id).storage_key
    return b"".join(ctx.storage.iter_chunks(key))


def test_a_stalled_finisher_cannot_replace_the_objects_of_the_attempt_that_took_over(server):
    ctx = server.ctx
    batch_id, shard_id = started_batch(server, "stall")
    held = ShardObjects(make_storage(ctx.settings))
    held.gate = threading.Event()
    # one shard at a time: while it stalls it claims nothing, so the other worker takes the shard
    stalled_jobs = open_context(ctx.settings.model_copy(update={"max_shards_in_flight": 1}), storage=held)
    stalled = runner(stalled_jobs, "stalled-worker")
    taker = None
    try:
        assert held.entered.wait(120), "the first runner never got to writing its shard"
        # it stalls mid-write while its lease runs out; the sweeper re-queues the shard
        with session_scope(ctx.sessions) as session:
            session.execute(update(Shard).where(Shard.id == shard_id).values(
                status="queued", lease_owner=None, lease_expires_at=None))
        taker = runner(ctx, "taker-worker")
        wait_until(lambda: status(ctx, batch_id) == "completed", timeout=120)
        output = output_of(ctx, batch_id)
        held.gate.set()  # the stalled finisher wakes up and writes its (earlier) attempt's objects
        wait_until(lambda: not stalled._held(), timeout=60)
        stale = [shard_output_key(batch_id, 0, 1), shard_error_key(batch_id, 0, 1)]
        assert held.written == stale  # written, then deleted: its complete found the lease gone
        assert not any(ctx.storage.exists(key) for key in stale)
    finally:
        held.gate.set()
        stalled.shutdown()
        stalled_jobs.close()
        if taker is not None:
            taker.shutdown()
    with ctx.sessions() as session:
        shard = session.get(Shard, shard_id)
        project_id = session.get(Batch, batch_id).project_id
    assert (shard.status, shard.attempts, shard.lease_owner) == ("succeeded", 2, "taker-worker")
    assert b"".join(ctx.storage.iter_chunks(shard.output_key)) == output
    assert b"".join(iter_partial_results(ctx, project_id, batch_id, "output")) == output
    assert len(output.splitlines()) == 4


def test_the_objects_a_dead_attempt_left_go_once_a_later_attempt_completes(server):
    ctx = server.ctx
    batch_id, shard_id = started_batch(server, "dead")
    # attempt 1 wrote its objects and died before completing; the sweeper re-queued the shard
    left = [shard_output_key(batch_id, 0, 1), shard_error_key(batch_id, 0, 1)]
    for key in left:
        ctx.storage.put_chunks(key, [b"a dead attempt's objects\n"])
    with session_scope(ctx.sessions) as session:
        session.execute(update(Shard).where(Shard.id == shard_id).values(attempts=1))
    worker = runner(ctx, "second-worker")
    try:
        wait_until(lambda: status(ctx, batch_id) == "completed", timeout=120)
    finally:
        worker.shutdown()
    with ctx.sessions() as session:
        shard = session.get(Shard, shard_id)
    assert (shard.attempts, shard.output_key) == (2, shard_output_key(batch_id, 0, 2))
    assert not any(ctx.storage.exists(key) for key in left)
    assert len(output_of(ctx, batch_id).splitlines()) == 4


def test_a_store_that_keeps_failing_loses_no_finished_request(server, monkeypatch):
    from batchapi.workers import shard_finisher

    monkeypatch.setattr(shard_finisher, "STORE_BACKOFF_SECONDS", 0.05)
    ctx = server.ctx
    batch_id, shard_id = started_batch(server, "refused")
    refusing = ShardObjects(make_storage(ctx.settings))
    refusing.refuse = True
    worker_jobs = open_context(ctx.settings, storage=refusing)
    worker = runner(worker_jobs, "refused-worker")
    try:
        assert refusing.entered.wait(120), "the runner never got to writing its shard"
        # every try refused: the results are written as request results, none dropped
        wait_until(lambda: rows(ctx, shard_id) == 4 and not worker._unstored(), timeout=30)
        with ctx.sessions() as session:
            shard, batch = session.get(Shard, shard_id), session.get(Batch, batch_id)
        assert (shard.status, shard.lease_owner) == ("running", "refused-worker")  # not marked done
        assert batch.request_completed == 4
        refusing.refuse = False  # the store is back; the lease runs out and the sweeper re-queues
        with session_scope(ctx.sessions) as session:
            session.execute(update(Shard).where(Shard.id == shard_id).values(lease_expires_at=1))
        assert leases.requeue_expired(ctx, shard_id)
        worker.wake()
        wait_until(lambda: status(ctx, batch_id) == "completed", timeout=120)
    finally:
        worker.shutdown()
        worker_jobs.close()
    with ctx.sessions() as session:
        shard, batch = session.get(Shard, shard_id), session.get(Batch, batch_id)
    assert (shard.status, shard.attempts) == ("succeeded", 2)
    assert (batch.request_completed, batch.request_failed) == (4, 0)  # counted once
    assert [line.count(b'"custom_id":"refused-') for line in output_of(ctx, batch_id).splitlines()] == [1] * 4
    assert rows(ctx, shard_id) == 0  # moved into the objects


def rows(ctx, shard_id: str) -> int:
    with ctx.sessions() as session:
        return session.scalar(select(func.count()).select_from(RequestResult).where(RequestResult.shard_id == shard_id))


def test_a_shard_that_cannot_start_while_the_database_blinks_leaves_the_feeder_running(server, monkeypatch):
    """The shard's input cannot be read and the database refuses its give-back as well: the feeder
    leaves it to its lease and goes on, and once the sweeper re-queues it the same worker runs it."""
    from sqlalchemy.exc import OperationalError

    from batchapi.workers import shard_runner

    ctx = server.ctx
    batch_id, shard_id = started_batch(server, "blink")
    read, release, tried = shard_runner.read_shard, leases.release, threading.Event()

    def unreadable_once(*args, **kwargs):
        if not tried.is_set():
            tried.set()
            raise StorageError("the store blinked")
        return read(*args, **kwargs)

    def refused(*args, **kwargs):  # the database blinked too, just then
        monkeypatch.setattr(leases, "release", release)
        raise OperationalError("UPDATE shards", None, ConnectionError("the database blinked"))

    monkeypatch.setattr(shard_runner, "read_shard", unreadable_once)
    monkeypatch.setattr(leases, "release", refused)
    worker = runner(ctx, "blinking-worker")
    try:
        assert tried.wait(120), "the runner never claimed the shard"
        wait_until(lambda: leases.release is release, timeout=30)  # its give-back was refused
        with session_scope(ctx.sessions) as session:  # its lease runs out; the sweeper re-queues the shard
            session.execute(update(Shard).where(Shard.id == shard_id).values(
                status="queued", lease_owner=None, lease_expires_at=None))
        wait_until(lambda: status(ctx, batch_id) == "completed", timeout=120)
    finally:
        worker.shutdown()
    with ctx.sessions() as session:
        shard = session.get(Shard, shard_id)
    assert (shard.status, shard.attempts, shard.given_back) == ("succeeded", 2, 0)
    assert len(output_of(ctx, batch_id).splitlines()) == 4

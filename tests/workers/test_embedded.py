"""The embedded default: API and worker in one process, SQLite, a local storage directory."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import OpenAI
from sqlalchemy import select, update

from batchapi.batches import leases
from batchapi.batches.sweeper import sweep
from batchapi.db.clock import now
from batchapi.db.migrate import upgrade
from batchapi.db.models import Shard
from batchapi.db.session import session_scope
from batchapi.workers.embedded import EmbeddedWorker
from tests.utils.batch_service import jsonl, live_server, service_settings
from tests.utils.waiting import wait_for_batch, wait_until
from tests.workers.helpers import assert_each_once, assert_usage_matches, lines_for

EMBEDDED = dict(
    shard_size=8, sweep_seconds=0.5, worker_poll_seconds=0.5, max_num_seqs=8, max_num_batched_tokens=256,
    kv_cache_gb=0.05, device="cpu", auth_required=False, lease_seconds=10, heartbeat_seconds=1.0,
)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_llama_dir):
    settings = service_settings(tmp_path_factory.mktemp("embedded"), tiny_llama_dir, **EMBEDDED)
    upgrade(settings)
    worker = EmbeddedWorker()
    with live_server(settings, dispatcher=worker, hook=worker.run, sweep_shards=True) as server:
        yield server


@pytest.fixture(scope="module")
def client(embedded) -> OpenAI:
    return OpenAI(base_url=embedded.base_url + "/v1", api_key="unused", max_retries=0)


def run(client: OpenAI, lines: list[dict]):
    uploaded = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def contents(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@contextmanager
def without_worker(settings, prefix: str, n: int):
    """A service with no worker, holding one batch of n lines that has reached in_progress."""
    upgrade(settings)
    with live_server(settings) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        lines = lines_for(server.app.state.model.id, n, prefix=prefix)
        batch = wait_for_batch(client, run(client, lines).id, {"in_progress"}, timeout=90)
        yield server, client, lines, batch


def test_upload_to_results_with_the_openai_sdk(client, embedded):
    model = embedded.app.state.model.id
    lines = lines_for(model, 40, prefix="sdk", max_tokens=5)
    lines[7]["body"]["max_tokens"] = 1
    batch = wait_for_batch(client, run(client, lines).id, timeout=90)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 40 and batch.request_counts.completed == 40
    output, errors = contents(client, batch.output_file_id), contents(client, batch.error_file_id)
    assert errors == [] and batch.error_file_id is None
    assert_each_once(lines, output, errors)
    assert_usage_matches(batch.model_dump(), output)
    by_id = {r["custom_id"]: r for r in output}
    body = by_id["sdk-7"]["response"]["body"]
    assert by_id["sdk-7"]["response"]["status_code"] == 200 and by_id["sdk-7"]["error"] is None
    assert body["object"] == "chat.completion" and body["model"] == model
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.model_extra["cost"]["currency"] == "usd"


def test_a_finalize_that_died_is_finished_by_the_sweeper(client, embedded):
    from batchapi.db.models import Batch

    lines = lines_for(embedded.app.state.model.id, 12, prefix="refinal")
    batch = wait_for_batch(client, run(client, lines).id, timeout=90)
    first = contents(client, batch.output_file_id)
    with session_scope(embedded.ctx.sessions) as session:  # as if the finalizer died half-way
        session.execute(update(Batch).where(Batch.id == batch.id).values(
            status="finalizing", finalizing_at=now() - 3600, completed_at=None, output_file_id=None,
            request_completed=0, input_tokens=0, cached_tokens=0, output_tokens=0,
        ))
    again = wait_for_batch(client, batch.id, timeout=90)
    assert again.status == "completed" and again.output_file_id != batch.output_file_id
    assert contents(client, again.output_file_id) == first
    assert again.request_counts == batch.request_counts and again.usage == batch.usage


def test_submit_command_follows_a_batch_to_its_results(client, embedded, tmp_path):
    lines = lines_for(embedded.app.state.model.id, 12, prefix="cli")
    path = tmp_path / "batch.jsonl"
    path.write_bytes(jsonl(lines))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "batchapi"), "submit", str(path), "--wait", "--show", "2",
         "--base-url", embedded.base_url + "/v1", "--api-key", "unused"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": completed, 12 completed, 0 failed" in done.stdout, done.stdout
    assert "cli-0" in done.stdout and "cost: " in done.stdout and "usd" in done.stdout


def test_cancel_aborts_in_flight_requests(client, embedded):
    model = embedded.app.state.model.id
    lines = lines_for(model, 120, prefix="stop", max_tokens=48, ignore_eos=True)
    batch = run(client, lines)
    wait_for_batch(client, batch.id, until=lambda b: b.status == "in_progress" and b.request_counts.completed >= 8,
                   timeout=90)
    client.batches.cancel(batch.id)
    batch = wait_for_batch(client, batch.id, timeout=90)  # aborted, not run out: len(output) < 120 below
    assert batch.status == "cancelled", batch
    output, errors = contents(client, batch.output_file_id), contents(client, batch.error_file_id)
    assert_each_once(lines, output, errors)
    assert 8 <= len(output) < 120
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_a_shard_out_of_attempts_fails_and_the_batch_completes(tmp_path, tiny_llama_dir):
    """No worker here: the test plays a worker that keeps dying, and runs the sweeper itself."""
    settings = service_settings(tmp_path, tiny_llama_dir, **{**EMBEDDED, "max_shard_attempts": 2})
    with without_worker(settings, "doomed", 10) as (server, client, lines, batch):
        ctx = server.ctx
        with ctx.sessions() as session:
            shard_ids = list(session.scalars(select(Shard.id).where(Shard.batch_id == batch.id)))
        for attempt in range(2):  # each attempt: claimed, then the worker dies (the lease runs out)
            for shard_id in shard_ids:
                assert leases.claim(ctx, shard_id, f"ghost-{attempt}") is not None
            with session_scope(ctx.sessions) as session:
                session.execute(update(Shard).values(lease_expires_at=now() - 1))
            report = sweep(ctx)
        assert sorted(report.closed) == sorted(shard_ids) and report.finalized == [batch.id]
        batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts.failed == 10 and batch.output_file_id is None
        errors = contents(client, batch.error_file_id)
        assert_each_once(lines, [], errors)
        assert {e["error"]["code"] for e in errors} == {"shard_failed"}


class EngineKilled(BaseException):
    """Not an Exception: it escapes EngineFront's guard around ``step`` and ends the engine thread."""


def started_front(settings, monkeypatch, step):
    """A running EngineFront whose engine steps with ``step(real_step)`` instead."""
    from batchapi.engine import EngineFront
    from batchapi.workers.engine_setup import engine_config_from

    front = EngineFront(engine_config_from(settings))
    real = front.engine.step
    monkeypatch.setattr(front.engine, "step", lambda: step(real))
    return front.start()


def counted(obj, name: str) -> list[float]:
    """The times ``obj.name`` is called from now on (wrapped on the instance, in the test only):
    evidence that a loop of the runner had its chances, for an assertion that it did nothing."""
    calls, method = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(time.monotonic())
        return method(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def looked_again(calls: list[float], times: int, what: str) -> None:
    start = len(calls)
    wait_until(lambda: len(calls) >= start + times, 30, 0.05, f"{what} {times} more times")


def shards_of(ctx, batch_id: str) -> list[Shard]:
    with ctx.sessions() as session:
        return list(session.scalars(select(Shard).where(Shard.batch_id == batch_id).order_by(Shard.index)))


def test_a_stuck_engine_lets_its_leases_run_out(tmp_path, tiny_llama_dir, monkeypatch):
    """An engine thread that lives but never returns from a step: the runner stops renewing,
    the sweeper re-queues."""
    from batchapi.workers.codec import Codec
    from batchapi.workers.shard_runner import ShardRunner

    settings = service_settings(tmp_path, tiny_llama_dir, **{**EMBEDDED, "lease_seconds": 5})
    unstuck = threading.Event()
    with without_worker(settings, "stuck", 4) as (server, _, _, batch):
        front = started_front(settings, monkeypatch, lambda real: unstuck.wait() and [])
        runner = ShardRunner(server.ctx, front, Codec(front.tokenizer, "tiny-llama"), "stuck-worker")
        beats, room = counted(runner._monitor, "_beat"), counted(runner, "_has_room")
        runner.start()
        try:
            wait_until(lambda: sweep(server.ctx).requeued, 30, 0.5, "the sweeper to take the stuck runner's lease")
            # the stuck runner does not take it back: not by a heartbeat, not by a claim
            looked_again(beats, 2, "the monitor to beat")
            looked_again(room, 5, "the feeder to look for room")
            (shard,) = shards_of(server.ctx, batch.id)
            assert (shard.status, shard.attempts, shard.lease_owner) == ("queued", 1, None)
            assert front.is_alive() and not runner.engine_dead.is_set()
        finally:
            unstuck.set()
            runner.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_gives_its_shards_back_at_once(tmp_path, tiny_llama_dir, monkeypatch):
    """The engine thread dies with shards in flight: they are back in the queue within seconds,
    not a lease later, and a healthy worker then runs the batch, each request once."""
    from batchapi.workers.codec import Codec
    from batchapi.workers.shard_runner import ShardRunner

    steps = itertools.count()

    def dies_on_the_third_step(real):
        if next(steps) == 2:  # no request has finished yet (each needs a prefill and 3 decodes)
            raise EngineKilled()
        return real()

    settings = service_settings(tmp_path, tiny_llama_dir, **{**EMBEDDED, "lease_seconds": 600})
    with without_worker(settings, "dead", 24) as (server, client, lines, batch):
        ctx, deaths = server.ctx, []
        front = started_front(settings, monkeypatch, dies_on_the_third_step)
        doomed = ShardRunner(ctx, front, Codec(front.tokenizer, "tiny-llama"), "doomed-worker",
                             on_engine_death=lambda: deaths.append(time.monotonic()))
        beats, room = counted(doomed._monitor, "_beat"), counted(doomed, "_has_room")
        doomed.start()
        try:
            wait_until(lambda: not front.is_alive(), 60, 0.05, "the engine to take a third step")
            wait_until(lambda: shards_of(ctx, batch.id), 10, 0.1, "the dead engine's shards to be given back",
                       until=lambda shards: deaths and not any(s.status == "running" for s in shards))
            assert len(deaths) == 1 and doomed._held() == []
            shards = shards_of(ctx, batch.id)
            assert {s.status for s in shards} == {"queued"} and {s.lease_owner for s in shards} == {None}
            assert 1 in {s.attempts for s in shards}  # some were claimed, and given back
            assert doomed.run_shard(shards[0].id) == "skipped"  # a dead engine claims nothing more
            looked_again(beats, 2, "the monitor to beat")
            looked_again(room, 5, "the feeder to look for room")
            assert all(s.lease_owner is None for s in shards_of(ctx, batch.id))
        finally:
            doomed.shutdown()
        front = started_front(settings, monkeypatch, lambda real: real())
        healthy = ShardRunner(ctx, front, Codec(front.tokenizer, "tiny-llama"), "healthy-worker").start()
        try:
            done = wait_for_batch(client, batch.id)
        finally:
            healthy.shutdown()
        assert done.status == "completed" and done.request_counts.completed == 24, done
        output, errors = contents(client, done.output_file_id), contents(client, done.error_file_id)
        assert errors == []
        assert_each_once(lines, output, errors)
        assert_usage_matches(done.model_dump(), output)
        assert {(s.status, s.lease_owner) for s in shards_of(ctx, batch.id)} == {("succeeded", "healthy-worker")}

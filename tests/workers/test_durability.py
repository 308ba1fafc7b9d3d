"""Per-request durability on the production path (API, Redis, a Celery worker subprocess,
PostgreSQL, SeaweedFS): inside one 64-request shard, counts and partial results move request by
request, a cancel or an expiry keeps every finished request, a retry runs exactly the rest, and a
worker killed with ``kill -9`` costs only the requests that had no durable result yet.

Each worker records the ids of the requests it hands its engine (a prelude in its process), so
the test can say which requests were computed, and by whom."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select, update

from batchapi.batches.states import TERMINAL
from batchapi.db.clock import now
from batchapi.db.models import Batch, RequestResult, Shard
from batchapi.db.session import session_scope
from tests.utils.waiting import read_batch, wait_for_batch
from tests.workers.conftest import WORKER_SETTINGS, running_cluster
from tests.workers.helpers import assert_each_once, assert_usage_matches, lines_for, results, submit
from tests.workers.processes import engine_cores

pytestmark = pytest.mark.slow

SHARD = 64
# one shard per batch, results written in groups of 4 or every 0.2 s; two sequences at a time
# so that a 64-request shard takes seconds on the tiny model
SETTINGS = {**WORKER_SETTINGS, "shard_size": SHARD, "result_flush_rows": 4, "result_flush_seconds": 0.2,
            "max_num_seqs": 2, "max_shards_in_flight": 1}
MAX_TOKENS = 96  # a 64-request shard takes seconds even on a fast, quiet machine

# run in the worker before `batchapi worker`: every request given to the engine is noted in a file
RECORD_REQUESTS = """
from batchapi.engine.core import EngineProcess

_submit_many, _path = EngineProcess.submit_many, {path!r}

def submit_many(self, requests, callback=None):
    with open(_path, "a") as f:
        f.write("".join(request.request_id + "\\n" for request in requests))
    return _submit_many(self, requests, callback)

EngineProcess.submit_many = submit_many
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3, tiny_llama_dir):
    with running_cluster(tmp_path_factory.mktemp("durability"), s3, tiny_llama_dir, "batchapi_durability",
                         SETTINGS) as cluster:
        yield cluster


def start_recording_worker(cluster) -> tuple[str, Path]:
    record = cluster.logdir / f"requests-{uuid.uuid4().hex[:6]}.txt"
    record.touch()
    name = cluster.start_worker(prelude=RECORD_REQUESTS.format(path=str(record)))
    cluster.wait_ready(name)
    return name, record


@pytest.fixture(scope="module")
def worker(cluster):
    """The one worker of the tests before the kill (the kill test starts its own)."""
    return start_recording_worker(cluster)


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return cluster.server.app.state.model.id


def shard_lines(model: str, prefix: str) -> list[dict]:
    return lines_for(model, SHARD, prefix=prefix, max_tokens=MAX_TOKENS, ignore_eos=True)


def the_shard(cluster, batch_id: str) -> Shard:
    with cluster.ctx.sessions() as session:
        shards = list(session.scalars(select(Shard).where(Shard.batch_id == batch_id)))
    assert len(shards) == 1, f"expected one shard, got {len(shards)}"
    return shards[0]


def computed(record: Path, shard_id: str) -> list[tuple[int, int]]:
    """(attempt, seq) of every request of the shard the worker gave its engine."""
    out = []
    for line in record.read_text().split():
        owner, attempt, seq = line.rsplit(":", 2)
        if owner == shard_id:
            out.append((int(attempt), int(seq)))
    return out


def mid_shard(batch: dict) -> bool:
    """Some requests durable, and most still to run: a cancel (seen by the worker within a
    second) lands well before the shard could finish."""
    return batch["status"] == "in_progress" and 8 <= batch["request_counts"]["completed"] <= SHARD // 3


def partial_count(http: httpx.Client, batch_id: str) -> int:
    response = http.get(f"/v1/batches/{batch_id}/partial_results")
    assert response.status_code == 200, response.text
    return len(response.text.splitlines())


def test_counts_and_partial_results_move_per_request_inside_one_shard(cluster, worker, model):
    lines = shard_lines(model, "progress")
    seen, partial = set(), set()
    with cluster.http() as http:
        batch_id = submit(http, lines)

        def ended_noting_progress(batch: dict) -> bool:
            if batch["status"] == "in_progress":
                seen.add(batch["request_counts"]["completed"])
                partial.add(partial_count(http, batch_id))
            return batch["status"] in TERMINAL

        batch = wait_for_batch(http, batch_id, until=ended_noting_progress, interval=0.05, message="the batch to end")
        assert batch["status"] == "completed", batch
        output, errors = results(http, batch)
    shard = the_shard(cluster, batch_id)
    between = sorted(c for c in seen if 0 < c < SHARD)
    assert len(between) >= 3, f"counts seen while running: {sorted(seen)}"
    assert len([c for c in partial if 0 < c < SHARD]) >= 3, f"partial result sizes seen: {sorted(partial)}"
    assert_each_once(lines, output, errors)
    assert batch["request_counts"] == {"total": SHARD, "completed": SHARD, "failed": 0}
    assert [r["custom_id"] for r in output] == [line["custom_id"] for line in lines]  # input order
    assert_usage_matches(batch, output)
    with cluster.ctx.sessions() as session:  # the rows went into the shard's objects
        assert session.scalar(select(RequestResult.seq).where(RequestResult.shard_id == shard.id).limit(1)) is None


@pytest.fixture(scope="module")
def cancelled(cluster, worker, model):
    """A 64-request batch cancelled mid-shard: (batch, lines, completed before the cancel)."""
    lines = shard_lines(model, "cancel")
    with cluster.http() as http:
        batch_id = submit(http, lines)
        mid = wait_for_batch(http, batch_id, until=mid_shard, message="some finished requests")
        before = mid["request_counts"]["completed"]
        response = http.post(f"/v1/batches/{batch_id}/cancel")
        assert response.status_code == 200, response.text
        batch = wait_for_batch(http, batch_id, timeout=60)
    assert batch["status"] == "cancelled", batch
    return batch, lines, before


def test_cancel_mid_shard_keeps_every_finished_request(cluster, cancelled):
    batch, lines, before = cancelled
    with cluster.http() as http:
        output, errors = results(http, batch)
    assert_each_once(lines, output, errors)
    assert before <= len(output) < SHARD
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert batch["request_counts"] == {"total": SHARD, "completed": len(output), "failed": len(errors)}
    assert_usage_matches(batch, output)


def test_retry_runs_exactly_the_unfinished_requests_once_per_key(cluster, cancelled):
    original, lines, _ = cancelled
    with cluster.http() as http:
        _, errors = results(http, original)
        key = {"Idempotency-Key": f"nightly-{uuid.uuid4().hex[:6]}"}
        first = http.post(f"/v1/batches/{original['id']}/retry", headers=key)
        assert first.status_code == 200, first.text
        retry = first.json()
        assert retry["retry_of"] == original["id"] and retry["id"] != original["id"]
        assert (retry["endpoint"], retry["completion_window"], retry["metadata"]) == (
            original["endpoint"], original["completion_window"], original["metadata"])
        again = http.post(f"/v1/batches/{original['id']}/retry", headers=key)
        assert again.status_code == 200 and again.json()["id"] == retry["id"]
        running = http.post(f"/v1/batches/{retry['id']}/retry")  # it has not ended
        assert running.status_code == 409 and running.json()["error"]["code"] == "invalid_state", running.text
        done = wait_for_batch(http, retry["id"])
        assert done["status"] == "completed", done
        output, retry_errors = results(http, done)
        nothing = http.post(f"/v1/batches/{done['id']}/retry")
        assert nothing.status_code == 400 and nothing.json()["error"]["code"] == "nothing_to_retry", nothing.text
        # the key names the first retry: with another batch it is refused
        reused = http.post(f"/v1/batches/{done['id']}/retry", headers=key)
        assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused", reused.text
    wanted = [line["custom_id"] for line in lines if line["custom_id"] in {e["custom_id"] for e in errors}]
    assert [r["custom_id"] for r in output] == wanted and retry_errors == []
    assert done["request_counts"] == {"total": len(wanted), "completed": len(wanted), "failed": 0}


def test_expiry_mid_shard_keeps_every_finished_request(cluster, worker, model):
    lines = shard_lines(model, "expire")
    with cluster.http() as http:
        batch_id = submit(http, lines)
        mid = wait_for_batch(http, batch_id, until=mid_shard, message="some finished requests")
        before = mid["request_counts"]["completed"]
        with session_scope(cluster.ctx.sessions) as session:  # the completion window runs out now
            session.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=now()))
        batch = wait_for_batch(http, batch_id, timeout=60)
        assert batch["status"] == "expired", batch
        output, errors = results(http, batch)
    assert_each_once(lines, output, errors)
    assert before <= len(output) < SHARD
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert_usage_matches(batch, output)


def test_kill_9_of_the_engine_core_mid_shard_loses_and_repeats_nothing(cluster, worker, model):
    """The worker's engine core process dies: the worker starts a new one and resubmits what was
    in flight; the shard stays the worker's (one attempt), every request ends once."""
    name, record = worker
    lines = shard_lines(model, "core")
    with cluster.http() as http:
        batch_id = submit(http, lines)
        wait_for_batch(http, batch_id, until=mid_shard, message="some finished requests")
        (core,) = engine_cores(cluster.workers[name].pid)
        os.kill(core, signal.SIGKILL)
        batch = wait_for_batch(http, batch_id)
        assert batch["status"] == "completed", batch
        output, errors = results(http, batch)
    assert engine_cores(cluster.workers[name].pid) not in ([], [core]), "no new engine core"
    shard = the_shard(cluster, batch_id)
    assert sorted(computed(record, shard.id)) == [(1, seq) for seq in range(SHARD)]  # never given up
    assert_each_once(lines, output, errors)
    assert errors == [] and batch["request_counts"] == {"total": SHARD, "completed": SHARD, "failed": 0}
    assert_usage_matches(batch, output)
    assert cluster.workers[name].poll() is None


def test_kill_9_mid_shard_recomputes_only_the_requests_without_a_result(cluster, worker, model):
    victim, victim_record = worker
    lines = shard_lines(model, "kill")
    with cluster.http() as http:
        batch_id = submit(http, lines)
        wait_for_batch(http, batch_id, until=mid_shard, message="some finished requests")
        cluster.kill_worker(victim)
        shard = the_shard(cluster, batch_id)
        with cluster.ctx.sessions() as session:  # frozen: nobody holds the shard until its lease runs out
            durable = set(session.scalars(select(RequestResult.seq).where(RequestResult.shard_id == shard.id)))
        counted = read_batch(http, batch_id)["request_counts"]["completed"]
        survivor, survivor_record = start_recording_worker(cluster)
        batch = wait_for_batch(http, batch_id)
        assert batch["status"] == "completed", batch
        output, errors = results(http, batch)
    assert len(durable) >= 8 and counted == len(durable)  # counted once, as they were written
    assert sorted(computed(victim_record, shard.id)) == [(1, seq) for seq in range(SHARD)]
    again = computed(survivor_record, shard.id)
    assert sorted(seq for _, seq in again) == sorted(set(range(SHARD)) - durable), "recomputed a durable result"
    assert {attempt for attempt, _ in again} == {2}
    assert_each_once(lines, output, errors)
    assert errors == [] and batch["request_counts"] == {"total": SHARD, "completed": SHARD, "failed": 0}
    assert_usage_matches(batch, output)
    assert cluster.workers[survivor].poll() is None

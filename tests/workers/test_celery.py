"""The production path: API, Redis, Celery worker subprocesses, PostgreSQL, SeaweedFS."""

from __future__ import annotations

import re

import pytest
import redis
from sqlalchemy import select

from batchapi.batches import leases
from batchapi.db.models import Shard
from batchapi.workers.celery_app import make_celery, send_shards
from tests.utils.waiting import read_batch, wait_for_batch, wait_until
from tests.workers.helpers import assert_each_once, assert_usage_matches, lines_for, results, submit

pytestmark = pytest.mark.slow


def wait_consumed(cluster, queue: str, timeout: float = 120) -> None:
    """Until no message of ``queue`` waits and none is unacknowledged: with late acks a task's
    message stays in kombu's ``unacked`` hash until the task has returned."""
    client = redis.Redis.from_url(cluster.redis.url)
    try:
        wait_until(lambda: client.llen(queue) == 0 and client.hlen("unacked") == 0, timeout, interval=0.1)
    finally:
        client.close()


@pytest.fixture(scope="module")
def two_workers(cluster):
    names = [cluster.start_worker(), cluster.start_worker()]
    for name in names:
        cluster.wait_ready(name)
    return names


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return cluster.server.app.state.model.id


def wait_completed(http, batch_id: str, lines: list[dict], timeout: float) -> tuple[dict, list[dict]]:
    """Waits for the batch to complete with no errors, each line answered once and usage that adds up."""
    batch = wait_for_batch(http, batch_id, timeout=timeout)
    assert batch["status"] == "completed", batch
    output, errors = results(http, batch)
    assert errors == []
    assert_each_once(lines, output, errors)
    assert_usage_matches(batch, output)
    return batch, output


def shards_of(cluster, batch_id: str) -> list[Shard]:
    with cluster.ctx.sessions() as session:
        return list(session.scalars(select(Shard).where(Shard.batch_id == batch_id).order_by(Shard.index)))


def test_happy_path_two_workers_share_one_batch(cluster, two_workers, model):
    lines = lines_for(model, 120, max_tokens=6)
    with cluster.http() as http:
        batch_id = submit(http, lines)
        batch, _ = wait_completed(http, batch_id, lines, timeout=180)
    assert batch["request_counts"] == {"total": 120, "completed": 120, "failed": 0}
    shards = shards_of(cluster, batch_id)
    assert len(shards) == 12 and {s.status for s in shards} == {"succeeded"}
    owners = {s.lease_owner.split(":")[1] for s in shards}  # the pid part of the owner
    assert len(owners) == 2, f"one worker ran every shard: {owners}"


def test_duplicated_task_messages_do_no_work_twice(cluster, two_workers, model):
    lines = lines_for(model, 30, prefix="dup")
    with cluster.http() as http:
        batch_id = submit(http, lines)
        first = wait_for_batch(http, batch_id)
        assert first["status"] == "completed", first
        before = [(s.id, s.attempts, s.finished_at, s.output_key) for s in shards_of(cluster, batch_id)]
        # the same messages again, twice: every claim finds the shard done
        app = make_celery(cluster.settings)
        shard_ids = [s[0] for s in before]
        send_shards(app, cluster.settings.celery_queue, shard_ids + shard_ids)
        assert leases.claim(cluster.ctx, shard_ids[0], "someone-else") is None
        wait_consumed(cluster, cluster.settings.celery_queue)  # the workers have handled every copy
        after = [(s.id, s.attempts, s.finished_at, s.output_key) for s in shards_of(cluster, batch_id)]
        assert after == before
        again = read_batch(http, batch_id)
        assert again["request_counts"] == first["request_counts"] and again["usage"] == first["usage"]
        output, errors = results(http, again)
    assert_each_once(lines, output, errors)


def long_lines(model: str, prefix: str, n: int = 200, max_tokens: int = 32) -> list[dict]:
    """Enough work to be caught in the middle: every request runs to max_tokens."""
    return lines_for(model, n, prefix=prefix, max_tokens=max_tokens, ignore_eos=True)


def some_done(batch: dict) -> bool:
    return batch["status"] == "in_progress" and batch["request_counts"]["completed"] >= 10


def test_cancel_mid_run_keeps_finished_results(cluster, two_workers, model):
    lines = long_lines(model, "cancel", n=600)  # still running when the cancel lands, on a fast machine too
    with cluster.http() as http:
        batch_id = submit(http, lines)
        wait_for_batch(http, batch_id, until=some_done, message="some finished requests")
        cancelled = http.post(f"/v1/batches/{batch_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling", cancelled.text
        batch = wait_for_batch(http, batch_id, timeout=90)  # aborted, not run out: len(output) < len(lines)
        assert batch["status"] == "cancelled", batch
        output, errors = results(http, batch)
    assert_each_once(lines, output, errors)
    assert 10 <= len(output) < len(lines)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert all(e["response"] is None for e in errors)
    assert_usage_matches(batch, output)
    assert batch["request_counts"] == {"total": len(lines), "completed": len(output), "failed": len(errors)}


def test_expiry_mid_run_keeps_finished_results(cluster, two_workers, model):
    from sqlalchemy import update

    from batchapi.db.clock import now
    from batchapi.db.models import Batch
    from batchapi.db.session import session_scope

    lines = long_lines(model, "expire", n=600)
    with cluster.http() as http:
        batch_id = submit(http, lines)
        wait_for_batch(http, batch_id, until=some_done, message="some finished requests")
        with session_scope(cluster.ctx.sessions) as session:  # the completion window runs out now
            session.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=now()))
        batch = wait_for_batch(http, batch_id, timeout=90)
        assert batch["status"] == "expired", batch
        output, errors = results(http, batch)
    assert_each_once(lines, output, errors)
    assert 10 <= len(output) < len(lines)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert_usage_matches(batch, output)


def test_redis_restart_mid_batch(cluster, two_workers, model):
    lines = long_lines(model, "redis", n=600)  # still running when the broker is back
    with cluster.http() as http:
        batch_id = submit(http, lines)
        wait_for_batch(http, batch_id, {"in_progress"}, timeout=60)
        # the shards' messages go with the broker; the database still knows the work
        cluster.redis.restart(down_seconds=1.0)
        assert read_batch(http, batch_id)["status"] == "in_progress"
        wait_completed(http, batch_id, lines, timeout=180)
    for name in two_workers:
        assert cluster.workers[name].poll() is None, cluster.worker_log(name)
    # and the restarted broker carries new work
    after = lines_for(model, 20, prefix="after-restart")
    with cluster.http() as http:
        batch = wait_for_batch(http, submit(http, after), timeout=60)
        assert batch["status"] == "completed", batch
        assert_each_once(after, *results(http, batch))


def test_kill_9_of_a_worker_mid_batch(cluster, two_workers, model):
    lines = long_lines(model, "kill")
    victim, survivor = two_workers
    victim_pid = str(cluster.workers[victim].pid)
    with cluster.http() as http:
        batch_id = submit(http, lines)

        def victim_busy(batch: dict) -> bool:
            running = [s for s in shards_of(cluster, batch_id) if s.status == "running"]
            return some_done(batch) and any(s.lease_owner.split(":")[1] == victim_pid for s in running)

        wait_for_batch(http, batch_id, until=victim_busy, message="the victim to hold a shard")
        cluster.kill_worker(victim)
        wait_completed(http, batch_id, lines, timeout=240)
    shards = shards_of(cluster, batch_id)
    assert max(s.attempts for s in shards) >= 2, "no shard was run again"
    assert all(s.lease_owner.split(":")[1] != victim_pid for s in shards if s.status == "succeeded" and s.attempts > 1)


# run in a worker process before `batchapi worker` whose engine runs on a thread of it
# (BATCHAPI_ENGINE_PROCESS=false): its engine thread dies at its 20th step. (An engine core in a
# child process that dies is restarted: tests/workers/test_durability.py, tests/engine/test_core.py.)
ENGINE_DIES = """
import itertools
from batchapi.engine.engine import LLMEngine

class EngineKilled(BaseException):  # not an Exception: it escapes EngineFront's guard and ends the thread
    pass

real_step, steps = LLMEngine.step, itertools.count()

def step(self):
    if next(steps) == 20:
        raise EngineKilled()
    return real_step(self)

LLMEngine.step = step
"""


def test_a_worker_whose_engine_dies_gives_its_shards_back_and_exits(cluster, two_workers, model):
    doomed = cluster.start_worker(prelude=ENGINE_DIES, env={"BATCHAPI_ENGINE_PROCESS": "false"})
    cluster.wait_ready(doomed)
    proc = cluster.workers[doomed]
    lines = long_lines(model, "dead-engine", n=120)
    with cluster.http() as http:
        batch_id = submit(http, lines)
        assert proc.wait(timeout=120) == 1, cluster.worker_log(doomed)
        wait_completed(http, batch_id, lines, timeout=240)
    log = cluster.worker_log(doomed)
    given_back = re.search(r"the engine thread died; gave (\d+) of (\d+) unfinished shards back", log)
    assert given_back and given_back[1] == given_back[2] != "0", log
    assert "exiting so that the supervisor restarts it" in log
    shards = shards_of(cluster, batch_id)
    assert max(s.attempts for s in shards) >= 2, "no shard was run again"
    for name in set(two_workers) & set(cluster.workers):  # the others (one may have been killed) run on
        assert cluster.workers[name].poll() is None, cluster.worker_log(name)

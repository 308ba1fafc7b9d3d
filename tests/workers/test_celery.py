"""The production path: API, Redis, Celery worker subprocesses, PostgreSQL, SeaweedFS."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from batchapi.jobs.models import Shard
from batchapi.workers import leases
from batchapi.workers.celery_app import make_celery, send_shards
from tests.workers.helpers import (
    assert_each_once,
    assert_usage_matches,
    get,
    lines_for,
    results,
    submit,
    wait_done,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_workers(cluster):
    names = [cluster.start_worker(), cluster.start_worker()]
    for name in names:
        cluster.wait_ready(name)
    return names


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return cluster.server.app.state.model.id


def shards_of(cluster, batch_id: str) -> list[Shard]:
    with cluster.jobs.sessions() as session:
        return list(session.scalars(select(Shard).where(Shard.batch_id == batch_id).order_by(Shard.index)))


def test_happy_path_two_workers_share_one_batch(cluster, two_workers, model):
    lines = lines_for(model, 120, max_tokens=6)
    with cluster.http() as http:
        batch_id = submit(http, lines)
        batch = wait_done(http, batch_id, timeout=180)
        assert batch["status"] == "completed", batch
        output, errors = results(http, batch)
    assert errors == []
    assert_each_once(lines, output, errors)
    assert_usage_matches(batch, output)
    assert batch["request_counts"] == {"total": 120, "completed": 120, "failed": 0}
    shards = shards_of(cluster, batch_id)
    assert len(shards) == 12 and {s.status for s in shards} == {"succeeded"}
    owners = {s.lease_owner.split(":")[1] for s in shards}  # the pid part of the owner
    assert len(owners) == 2, f"one worker ran every shard: {owners}"


def test_duplicated_task_messages_do_no_work_twice(cluster, two_workers, model):
    lines = lines_for(model, 30, prefix="dup")
    with cluster.http() as http:
        batch_id = submit(http, lines)
        first = wait_done(http, batch_id, timeout=120)
        assert first["status"] == "completed", first
        before = [(s.id, s.attempts, s.finished_at, s.output_key) for s in shards_of(cluster, batch_id)]
        # the same messages again, twice: every claim finds the shard done
        app = make_celery(cluster.settings)
        shard_ids = [s[0] for s in before]
        send_shards(app, cluster.settings.celery_queue, shard_ids + shard_ids)
        assert leases.claim(cluster.jobs, shard_ids[0], "someone-else") is None
        time.sleep(3)
        after = [(s.id, s.attempts, s.finished_at, s.output_key) for s in shards_of(cluster, batch_id)]
        assert after == before
        again = get(http, batch_id)
        assert again["request_counts"] == first["request_counts"] and again["usage"] == first["usage"]
        output, errors = results(http, again)
    assert_each_once(lines, output, errors)

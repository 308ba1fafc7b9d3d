"""A worker restarted under the same identity takes back the shards its earlier process held, at
once, and that process, were it still alive, is fenced off (``leases.take_back``), on both databases."""

from __future__ import annotations

import dataclasses

from batchapi.batches import leases, request_results
from batchapi.batches.leases import Outcome
from batchapi.batches.states import ShardStatus
from batchapi.batches.sweeper import sweep
from batchapi.db.clock import now
from batchapi.db.models import Shard
from batchapi.db.session import session_scope
from tests.utils.job_rows import make_batch, shard

IDENTITY = "host-a:embedded"
EARLIER = f"{IDENTITY}/101:aaaaaa"
RESTARTED = f"{IDENTITY}/202:bbbbbb"


def test_a_restarted_worker_requeues_what_its_earlier_process_held(any_jobs):
    ctx = any_jobs
    _, (mine, also_mine, queued) = make_batch(ctx, shards=3)
    _, (other,) = make_batch(ctx, shards=1)
    _, (look_alike,) = make_batch(ctx, shards=1)
    held = [leases.claim(ctx, mine, EARLIER), leases.claim(ctx, also_mine, EARLIER)]
    assert leases.claim(ctx, other, "host-a:other/303:cccccc") is not None
    assert leases.claim(ctx, look_alike, f"{IDENTITY}x/404:dddddd") is not None  # a longer name, not this one

    assert leases.take_back(ctx, IDENTITY, RESTARTED) == (2, 0)

    for shard_id, claimed in zip((mine, also_mine), held, strict=True):
        row = shard(ctx, shard_id)
        assert (row.status, row.lease_owner, row.lease_expires_at) == (ShardStatus.QUEUED, None, None)
        assert row.attempts == claimed.attempts == 1  # the next claim counts the next attempt
    assert shard(ctx, queued).status == ShardStatus.QUEUED
    assert shard(ctx, other).lease_owner == "host-a:other/303:cccccc"
    assert shard(ctx, look_alike).lease_owner == f"{IDENTITY}x/404:dddddd"
    # the restarted worker's own leases are never its earlier process's
    again = leases.claim(ctx, mine, RESTARTED)
    assert again is not None and again.attempts == 2
    assert leases.take_back(ctx, IDENTITY, RESTARTED) == (0, 0)
    assert shard(ctx, mine).lease_owner == RESTARTED


def test_an_earlier_process_still_alive_is_fenced_off(any_jobs):
    ctx = any_jobs
    _, (shard_id,) = make_batch(ctx, shards=1)
    claimed = leases.claim(ctx, shard_id, EARLIER)
    assert leases.take_back(ctx, IDENTITY, RESTARTED) == (1, 0)
    mine = leases.claim(ctx, shard_id, RESTARTED)
    assert mine is not None

    # the earlier process carries on as if nothing happened: every write it tries matches no row
    assert leases.heartbeat(ctx, [shard_id], EARLIER) == set()
    row = request_results.Finished(seq=0, succeeded=True, line=b'{"custom_id": "r0"}\n', output_tokens=3)
    group = request_results.Group(shard_id, claimed.batch_id, claimed.attempts, [row])
    assert request_results.record(ctx, [group], EARLIER) == set()
    assert not leases.complete(ctx, claimed, EARLIER, Outcome(completed=1, failed=0), "out", "err")
    assert leases.release(ctx, [shard_id], EARLIER) == 0
    after = shard(ctx, shard_id)
    assert (after.status, after.lease_owner, after.attempts) == (ShardStatus.RUNNING, RESTARTED, 2)
    assert request_results.stored(ctx, shard_id) == {}
    # while the restarted worker's own writes go through
    assert leases.heartbeat(ctx, [shard_id], RESTARTED) == {shard_id}
    assert leases.complete(ctx, mine, RESTARTED, Outcome(completed=1, failed=0), "out", "err")
    assert shard(ctx, shard_id).status == ShardStatus.SUCCEEDED


def test_a_shard_out_of_attempts_is_left_to_the_sweeper_at_once(any_jobs):
    ctx = dataclasses.replace(any_jobs, settings=any_jobs.settings.model_copy(update={"max_shard_attempts": 2}))
    _, (shard_id,) = make_batch(ctx, shards=1)
    assert leases.claim(ctx, shard_id, "host-b:gpu0/1:eeeeee") is not None
    assert leases.take_back(ctx, "host-b:gpu0", "host-b:gpu0/2:ffffff") == (1, 0)
    assert leases.claim(ctx, shard_id, "host-b:gpu0/2:ffffff").attempts == 2  # and that one died too

    assert leases.take_back(ctx, "host-b:gpu0", "host-b:gpu0/3:gggggg") == (0, 1)
    row = shard(ctx, shard_id)
    # not run a third time: its lease has run out, for the sweeper to close it as shard_failed
    assert row.status == ShardStatus.RUNNING and row.lease_owner == "host-b:gpu0/3:gggggg"
    assert row.lease_expires_at < now()
    assert leases.claim(ctx, shard_id, "host-b:gpu0/3:gggggg") is None


def test_claims_given_back_are_not_lost_leases(any_jobs):
    """Three deploys, each worker giving the shard back as it stops, then a worker killed: one lost
    lease of the two allowed, so the shard runs again (counting every claim would have failed it)."""
    ctx = dataclasses.replace(any_jobs, settings=any_jobs.settings.model_copy(update={"max_shard_attempts": 2}))
    _, (shard_id,) = make_batch(ctx, shards=1)
    for n in range(1, 4):
        assert leases.claim(ctx, shard_id, f"host-c:gpu0/{n}:aaaaaa").attempts == n
        assert leases.release(ctx, [shard_id], f"host-c:gpu0/{n}:aaaaaa") == 1
    assert leases.claim(ctx, shard_id, "host-c:gpu0/4:bbbbbb").attempts == 4  # and that one is killed
    assert leases.take_back(ctx, "host-c:gpu0", "host-c:gpu0/5:cccccc") == (1, 0)
    assert leases.claim(ctx, shard_id, "host-c:gpu0/5:cccccc").attempts == 5  # it runs again
    with session_scope(ctx.sessions) as session:  # killed again, no restart: the sweeper finds its lease run out
        session.get(Shard, shard_id).lease_expires_at = now() - 1
    report = sweep(ctx)
    assert shard_id in report.closed and shard(ctx, shard_id).status == ShardStatus.FAILED  # the second lost lease


def test_a_claim_whose_engine_died_running_it_is_a_lost_lease(any_jobs):
    """The shard may be what killed the engine: given back as lost, it counts, so a shard that kills
    every engine it meets ends as shard_failed instead of going round the workers for good."""
    ctx = dataclasses.replace(any_jobs, settings=any_jobs.settings.model_copy(update={"max_shard_attempts": 2}))
    _, (shard_id,) = make_batch(ctx, shards=1)
    for n in (1, 2):
        assert leases.claim(ctx, shard_id, f"host-d:gpu0/{n}:aaaaaa") is not None
        assert leases.release(ctx, [shard_id], f"host-d:gpu0/{n}:aaaaaa", lost=True) == 1
    assert shard(ctx, shard_id).given_back == 0
    assert leases.claim(ctx, shard_id, "host-d:gpu0/3:bbbbbb") is not None  # and that worker is killed
    assert leases.take_back(ctx, "host-d:gpu0", "host-d:gpu0/4:cccccc") == (0, 1)  # three lost: ended

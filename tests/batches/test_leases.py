"""Shard leases on PostgreSQL: one winner per claim, owner-checked writes, SKIP LOCKED pulling."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select, update

from batchapi.batches import leases
from batchapi.batches.leases import Outcome
from batchapi.context import open_context
from batchapi.db.clock import now
from batchapi.db.migrate import upgrade
from batchapi.db.models import Batch, Shard
from batchapi.db.session import session_scope
from tests.utils import services
from tests.utils.batch_service import service_settings
from tests.utils.job_rows import make_batch, shard


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, tiny_llama_dir):
    with services.fresh_database("batchapi_leases") as url:
        settings = service_settings(tmp_path_factory.mktemp("leases"), tiny_llama_dir, pg_url=url, lease_seconds=30)
        upgrade(settings)
        ctx = open_context(settings)
        yield ctx
        ctx.close()


def test_a_shard_is_claimed_once(ctx):
    _, (sid,) = make_batch(ctx, 1)
    first = leases.claim(ctx, sid, "a")
    assert first is not None and first.attempts == 1
    assert leases.claim(ctx, sid, "b") is None
    assert shard(ctx, sid).lease_owner == "a"


def test_no_claims_for_cancelled_or_expired_batches(ctx):
    _, (cancelled,) = make_batch(ctx, 1, status="cancelling")
    _, (expired,) = make_batch(ctx, 1, expires_in=-1)
    assert leases.claim(ctx, cancelled, "a") is None
    assert leases.claim(ctx, expired, "a") is None
    assert shard(ctx, cancelled).status == shard(ctx, expired).status == "queued"


def test_concurrent_pullers_get_distinct_shards(ctx):
    batch_id, ids = make_batch(ctx, 12)
    got: list[str] = []
    lock = threading.Lock()

    def pull(owner: str) -> None:
        while (claimed := leases.claim_next(ctx, owner)) is not None:
            with lock:
                got.append(claimed.id)

    threads = [threading.Thread(target=pull, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    mine = [g for g in got if g.startswith(batch_id)]
    assert sorted(mine) == ids  # each exactly once


def test_a_lost_lease_cannot_write(ctx):
    batch_id, (sid,) = make_batch(ctx, 1)
    claimed = leases.claim(ctx, sid, "slow")
    assert leases.heartbeat(ctx, [sid], "slow") == {sid}
    with session_scope(ctx.sessions) as session:  # the lease runs out
        session.execute(update(Shard).where(Shard.id == sid).values(lease_expires_at=now() - 1))
    assert leases.requeue_expired(ctx, sid)
    retry = leases.claim(ctx, sid, "fast")
    assert retry is not None and retry.attempts == 2
    outcome = Outcome(completed=1, failed=0, input_tokens=7, output_tokens=3)
    assert leases.heartbeat(ctx, [sid], "slow") == set()
    assert not leases.complete(ctx, claimed, "slow", outcome, "o", "e")
    assert leases.complete(ctx, retry, "fast", outcome, "o", "e")
    assert not leases.complete(ctx, retry, "fast", outcome, "o", "e")  # once only
    with ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
        assert (batch.request_completed, batch.input_tokens, batch.output_tokens) == (1, 7, 3)
    assert shard(ctx, sid).status == "succeeded"


def test_release_puts_shards_back(ctx):
    _, ids = make_batch(ctx, 2)
    for sid in ids:
        assert leases.claim(ctx, sid, "leaving")
    assert leases.release(ctx, ids, "someone-else") == 0
    assert leases.release(ctx, ids, "leaving") == 2
    with ctx.sessions() as session:
        rows = session.execute(select(Shard.status, Shard.lease_owner).where(Shard.id.in_(ids))).all()
    assert set(rows) == {("queued", None)}

"""Fair share between projects on PostgreSQL: the claim order (weights, priorities, deadline risk),
the plan's finish times, and two stand-in workers running the real claim and complete code."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, update

from batchapi.batches import leases
from batchapi.batches.leases import Outcome
from batchapi.batches.sharing import fair_share
from batchapi.batches.sharing.fair_share import Queued, finish_times
from batchapi.batches.states import ShardStatus
from batchapi.context import open_context
from batchapi.db.clock import now
from batchapi.db.migrate import upgrade
from batchapi.db.models import Batch, Shard
from batchapi.db.session import session_scope
from tests.utils import services
from tests.utils.batch_service import service_settings
from tests.utils.job_rows import make_batch, make_project


@pytest.fixture(scope="module")
def module_ctx(tmp_path_factory, tiny_llama_dir):
    with services.fresh_database("batchapi_fair") as url:
        settings = service_settings(tmp_path_factory.mktemp("fair"), tiny_llama_dir, pg_url=url, lease_seconds=60)
        upgrade(settings)
        ctx = open_context(settings)
        yield ctx
        ctx.close()


@pytest.fixture
def ctx(module_ctx):
    """Each test starts with an empty queue and no work given to anyone."""
    with session_scope(module_ctx.sessions) as session:
        session.execute(update(Shard).where(Shard.status.in_([ShardStatus.QUEUED, ShardStatus.RUNNING]))
                        .values(status=ShardStatus.FAILED))
        session.execute(update(Shard).values(started_at=0, finished_at=0))
        session.execute(update(Batch).where(Batch.status == "in_progress").values(status="completed"))
    return module_ctx


def batch_of(shard_id: str) -> str:
    return shard_id.rsplit("_", 1)[0]


def project_of(ctx, batch_ids: dict[str, str], claimed) -> str:
    return batch_ids[claimed.batch_id]


# ---- the plan, as a fluid ----


def test_equal_projects_share_the_fleet_and_a_project_runs_its_batches_in_order():
    batches = [Queued("a1", "A", 100, 0, 1, 10**6, False), Queued("a2", "A", 100, 0, 2, 10**6, False),
               Queued("b1", "B", 100, 0, 3, 10**6, False)]
    finish = finish_times(batches, {"A": 1, "B": 1}, rate=10.0, t=0)
    # A and B at 5/s each until both heads end at 20 s; then a2 alone at 10/s
    assert finish == pytest.approx({"a1": 20.0, "b1": 20.0, "a2": 30.0})


def test_weights_split_the_rate_and_risk_goes_first():
    batches = [Queued("a", "A", 300, 0, 1, 10**6, False), Queued("b", "B", 100, 0, 2, 10**6, False),
               Queued("late", "C", 50, 0, 3, 10, True)]
    finish = finish_times(batches, {"A": 3, "B": 1, "C": 1}, rate=10.0, t=0)
    assert finish["late"] == pytest.approx(5.0)  # the whole fleet first
    assert finish["a"] == pytest.approx(45.0) and finish["b"] == pytest.approx(45.0)  # 7.5/s and 2.5/s


def test_priority_orders_a_projects_batches():
    batches = [Queued("old", "A", 100, 0, 1, 10**6, False), Queued("urgent", "A", 100, 5, 2, 10**6, False)]
    finish = finish_times(batches, {"A": 1}, rate=10.0, t=0)
    assert finish["urgent"] < finish["old"]


# ---- the claim order ----


def test_a_new_project_goes_before_the_project_that_was_given_work(ctx):
    a = make_project(ctx)
    t = now()
    a_batches = [make_batch(ctx, 4, project_id=a, work=1000, created_at=t + i)[0] for i in range(3)]
    first = leases.claim_next(ctx, "w1")
    assert first.batch_id == a_batches[0]
    b_batch, _ = make_batch(ctx, 2, work=100)  # another project, later
    assert [leases.claim_next(ctx, "w1").batch_id for _ in range(2)] == [b_batch, b_batch]
    assert leases.claim_next(ctx, "w1").batch_id == a_batches[0]  # FIFO within A again


def test_weights_three_to_one_give_three_to_one_claims(ctx):
    a, b = make_project(ctx, weight=3), make_project(ctx, weight=1)
    owner = {make_batch(ctx, 60, project_id=a, work=500)[0]: "A", make_batch(ctx, 60, project_id=b, work=500)[0]: "B"}
    got = [owner[leases.claim_next(ctx, "w").batch_id] for _ in range(40)]
    assert (got.count("A"), got.count("B")) == (30, 10)


def test_priority_within_a_project_and_deadline_risk_before_everyone(ctx):
    a = make_project(ctx)
    low, _ = make_batch(ctx, 2, project_id=a, work=10)
    high, _ = make_batch(ctx, 2, project_id=a, work=10, priority=5)
    assert leases.claim_next(ctx, "w").batch_id == high
    risky, _ = make_batch(ctx, 2, work=10**6)  # another project with far more work each shard
    other, _ = make_batch(ctx, 2, work=1)
    with session_scope(ctx.sessions) as session:
        session.execute(update(Batch).where(Batch.id == risky).values(deadline_risk_at=now()))
    assert leases.claim_next(ctx, "w").batch_id == risky
    assert leases.claim_next(ctx, "w").batch_id == risky
    assert leases.claim_next(ctx, "w").batch_id in (other, low, high)


def test_the_plan_marks_a_batch_that_cannot_meet_its_window(ctx):
    t = now()
    done, done_ids = make_batch(ctx, 10, work=1000)
    with session_scope(ctx.sessions) as session:  # the fleet ran 10,000 estimated tokens in the last 10 s
        session.execute(update(Shard).where(Shard.id.in_(done_ids)).values(
            status=ShardStatus.SUCCEEDED, started_at=t - 10, finished_at=t))
        session.execute(update(Batch).where(Batch.id == done).values(status="completed"))
    fine, _ = make_batch(ctx, 5, work=1000, expires_in=3600)  # 5 s of work
    late, _ = make_batch(ctx, 50, work=1000, expires_in=30)  # 50 s of work in 30 s: at risk
    plan = fair_share.plan(ctx)
    assert plan.rate == pytest.approx(1000.0, rel=0.15) and plan.at_risk == [late]  # 10 s, or 11 past a tick
    with ctx.sessions() as session:
        rows = {b.id: b for b in session.scalars(select(Batch).where(Batch.id.in_([fine, late])))}
    assert rows[late].deadline_risk_at is not None and rows[fine].deadline_risk_at is None
    # served first, the late batch ends after its 50 s; the fine one after both, at 55 s
    assert rows[late].estimated_completion_at == pytest.approx(t + 50_000 / plan.rate, abs=2)
    assert rows[fine].estimated_completion_at == pytest.approx(t + 55_000 / plan.rate, abs=2)


# ---- two stand-in workers on the real claim and complete ----


class Workers:
    """``n`` threads that claim by the real rule and complete each shard after ``seconds``."""

    def __init__(self, ctx, n: int = 2, seconds: float = 0.05):
        self.ctx, self.seconds = ctx, seconds
        self.log: list[tuple[float, str, str]] = []  # (monotonic time, "claim"/"done", batch id)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.work, args=(f"sim-{i}",), daemon=True) for i in range(n)]

    def work(self, owner: str) -> None:
        while not self.stop.is_set():
            claimed = leases.claim_next(self.ctx, owner)
            if claimed is None:
                time.sleep(0.01)
                continue
            self.log.append((time.monotonic(), "claim", claimed.batch_id))
            time.sleep(self.seconds)
            leases.complete(self.ctx, claimed, owner, Outcome(completed=1, failed=0), "none", "none")
            self.log.append((time.monotonic(), "done", claimed.batch_id))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)


def test_a_small_batch_waits_for_at_most_one_large_shard_per_worker(ctx):
    a = make_project(ctx)
    a_batches = {make_batch(ctx, 20, project_id=a, work=5000)[0] for _ in range(20)}
    with Workers(ctx, n=2, seconds=0.05) as workers:
        time.sleep(0.5)
        b_batch, _ = make_batch(ctx, 4, work=500)
        arrived = time.monotonic()  # committed: a loaded machine may take a while over the insert
        deadline = time.monotonic() + 30
        while sum(1 for _, kind, bid in workers.log if kind == "done" and bid == b_batch) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b_done = max(at for at, kind, bid in workers.log if kind == "done" and bid == b_batch)
    a_claimed_meanwhile = [at for at, kind, bid in workers.log
                           if kind == "claim" and bid in a_batches and arrived < at < b_done]
    # a worker may have been between its claim and the row's commit when B arrived: one each at most
    assert len(a_claimed_meanwhile) <= 2, a_claimed_meanwhile


def test_weighted_throughput_over_a_window(ctx):
    a, b = make_project(ctx, weight=3), make_project(ctx, weight=1)
    owner = {make_batch(ctx, 200, project_id=a, work=500)[0]: "A", make_batch(ctx, 200, project_id=b, work=500)[0]: "B"}
    with Workers(ctx, n=2, seconds=0.02) as workers:
        time.sleep(3.0)
    done = [owner[bid] for _, kind, bid in workers.log if kind == "done" and bid in owner]
    assert len(done) >= 40
    ratio = done.count("A") / done.count("B")
    assert 2.7 <= ratio <= 3.3, (done.count("A"), done.count("B"))


def test_the_estimated_completion_is_within_a_quarter_of_the_real_one(ctx):
    """The database's clock counts whole seconds, so the workload runs long enough for them."""
    a = make_project(ctx)
    make_batch(ctx, 400, project_id=a, work=1000)  # a steady backlog that gives the plan its rate
    # each shard mostly waits (as on a GPU), so the rate does not follow what else the CPU runs
    with Workers(ctx, n=3, seconds=0.2) as workers:
        time.sleep(6.0)
        per_second = sum(1 for at, kind, _ in workers.log if kind == "done" and at > time.monotonic() - 5) / 5
        shards = max(int(per_second * 5), 10)  # about five seconds of work, before the backlog
        target, _ = make_batch(ctx, shards, project_id=a, work=1000, priority=5)
        started, t0 = time.time(), time.monotonic()
        fair_share.plan(ctx)
        with ctx.sessions() as session:
            eta = session.get(Batch, target).estimated_completion_at
        deadline = t0 + 60
        while sum(1 for _, kind, bid in workers.log if kind == "done" and bid == target) < shards:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        real = time.monotonic() - t0
    assert eta is not None
    predicted = eta - started
    assert abs(predicted - real) <= 0.25 * real, (predicted, real)

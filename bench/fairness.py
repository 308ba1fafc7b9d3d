"""Fair share between projects against first come, first served, on the real PostgreSQL.

    .venv/bin/python bench/fairness.py [--workers 8] [--shard-seconds 0.05] [--claim-seconds 5]

Part 1, waiting: for 2 and for 10 projects, all but the last queue large batches (``--large``
batches of ``--shards`` shards each, 5,000 estimated tokens a shard); once the workers are busy on
them, the last project submits one small batch of 4 shards. ``--workers`` simulated workers
(threads) run the real claim (``leases.claim_next``) and complete (``leases.complete``) code; a
shard takes ``--shard-seconds``, as if a GPU ran it. Printed: how long the small batch took from
its creation to its last shard done, and how many other shards were claimed before its last one
was (the shards it waited behind), under the
old order (``fair_share.fifo_order``) and under the fair share (``fair_share.claim_order``).

Part 2, the claim rate: 10 projects with 20 batches of 50 shards each queued (10,000 shards,
analyzed as autovacuum would have), and one claimer, then ``--workers`` claimers (threads of this
one Python process, so they share its GIL), claiming as fast as they can (no work between claims)
for ``--claim-seconds``: the claims per second each order sustains, and a claim's mean time.

Printed, never asserted: timings are noisy on a shared CPU.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from procs import cpu_model  # noqa: E402

from batchapi.batches import leases  # noqa: E402
from batchapi.batches.leases import Outcome  # noqa: E402
from batchapi.batches.sharing import fair_share  # noqa: E402
from batchapi.batches.states import ShardStatus  # noqa: E402
from batchapi.config import load_settings  # noqa: E402
from batchapi.context import open_context  # noqa: E402
from batchapi.db.clock import now  # noqa: E402
from batchapi.db.migrate import upgrade  # noqa: E402
from batchapi.db.models import Batch, File, Project, Shard  # noqa: E402
from batchapi.db.session import session_scope  # noqa: E402

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
ORDERS = {"first come, first served": fair_share.fifo_order, "fair share": fair_share.claim_order}


def project(ctx) -> str:
    pid = f"proj_{uuid.uuid4().hex[:12]}"
    with session_scope(ctx.sessions) as session:
        session.add(Project(id=pid, name=pid, created_at=now()))
    return pid


def batch(ctx, project_id: str, shards: int, work: int) -> str:
    """A running batch of one-request shards of ``work`` estimated tokens each."""
    t, bid = now(), f"batch_{uuid.uuid4().hex[:16]}"
    with session_scope(ctx.sessions) as session:
        session.add(File(id=f"file-{bid}", project_id=project_id, filename="in.jsonl", purpose="batch", bytes=0,
                         storage_key="files/none", created_at=t))
        session.add(Batch(id=bid, project_id=project_id, endpoint="/v1/chat/completions", input_file_id=f"file-{bid}",
                          completion_window="24h", status="in_progress", created_at=t, in_progress_at=t,
                          expires_at=t + 86400, request_total=shards, estimated_input_tokens=work * shards,
                          price_input=Decimal(1), price_cached_input=Decimal(1), price_output=Decimal(1),
                          discount_percent=Decimal(50)))
        session.flush()
        session.add_all(Shard(id=f"{bid}_{i:05d}", batch_id=bid, index=i, first_line=i + 1, last_line=i + 1,
                              start_byte=0, end_byte=0, request_count=1, prompt_tokens=work,
                              status=ShardStatus.QUEUED, created_at=t) for i in range(shards))
    return bid


def clear(ctx) -> None:
    """An empty queue and no work given to anyone: each scenario starts alike."""
    with session_scope(ctx.sessions) as session:
        session.query(Shard).filter(Shard.status.in_([ShardStatus.QUEUED, ShardStatus.RUNNING])).update(
            {"status": ShardStatus.FAILED}, synchronize_session=False)
        session.query(Shard).update({"started_at": 0, "finished_at": 0}, synchronize_session=False)
        session.query(Batch).filter(Batch.status == "in_progress").update({"status": "completed"},
                                                                          synchronize_session=False)


class Workers:
    def __init__(self, ctx, n: int, seconds: float, order, complete: bool = True):
        self.ctx, self.seconds, self.order, self.complete = ctx, seconds, order, complete
        self.log: list[tuple[float, str, str]] = []
        self.claim_times: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.work, args=(f"sim-{i}",), daemon=True) for i in range(n)]

    def work(self, owner: str) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            claimed = leases.claim_next(self.ctx, owner, order=self.order)
            self.claim_times.append(time.perf_counter() - start)
            if claimed is None:
                time.sleep(0.01)
                continue
            self.log.append((time.monotonic(), "claim", claimed.batch_id))
            if not self.complete:
                continue
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
            thread.join(timeout=30)


def waiting(ctx, projects: int, args, order) -> tuple[float, int]:
    clear(ctx)
    for _ in range(projects - 1):
        pid = project(ctx)
        for _ in range(args.large):
            batch(ctx, pid, args.shards, 5000)
    with Workers(ctx, args.workers, args.shard_seconds, order) as workers:
        time.sleep(1.0)
        arrived = time.monotonic()
        small = batch(ctx, project(ctx), 4, 500)
        deadline = arrived + args.timeout
        while sum(1 for _, kind, bid in workers.log if kind == "done" and bid == small) < 4:
            if time.monotonic() > deadline:
                return float("inf"), -1
            time.sleep(0.005)
        finished = max(at for at, kind, bid in workers.log if kind == "done" and bid == small)
        last_claim = max(at for at, kind, bid in workers.log if kind == "claim" and bid == small)
        others = sum(1 for at, kind, bid in workers.log
                     if kind == "claim" and bid != small and arrived < at < last_claim)
    return finished - arrived, others


def analyze(ctx) -> None:
    """Fresh statistics, as autovacuum keeps them on a table that grows over hours, not seconds."""
    with ctx.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE shards; ANALYZE batches; ANALYZE projects")
        conn.commit()


def claim_rate(ctx, claimers: int, seconds: float, order) -> tuple[float, float]:
    clear(ctx)
    for _ in range(10):
        pid = project(ctx)
        for _ in range(20):
            batch(ctx, pid, 50, 1000)
    analyze(ctx)
    with Workers(ctx, claimers, 0.0, order, complete=False) as workers:
        time.sleep(seconds)
    claims = sum(1 for _, kind, _ in workers.log if kind == "claim")
    mean_ms = 1000 * sum(workers.claim_times) / max(len(workers.claim_times), 1)
    return claims / seconds, mean_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--shard-seconds", type=float, default=0.05)
    parser.add_argument("--large", type=int, default=5, help="large batches per busy project")
    parser.add_argument("--shards", type=int, default=40, help="shards per large batch")
    parser.add_argument("--claim-seconds", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    name = f"batchapi_bench_fair_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        settings = load_settings(database_url=f"postgresql://postgres@127.0.0.1:5432/{name}",
                                 db_pool_size=args.workers + 4)
        upgrade(settings)
        ctx = open_context(settings)
        print(f"CPU: {cpu_model()}; {args.workers} simulated workers, {args.shard_seconds * 1000:.0f} ms a shard")
        print("\n| projects | order | small batch done after (s) | other shards claimed before its last |")
        print("|---|---|---|---|")
        for projects in (2, 10):
            for label, order in ORDERS.items():
                took, others = waiting(ctx, projects, args, order)
                print(f"| {projects} | {label} | {took:.2f} | {others} |", flush=True)
        print("\n| order | claimers | claims/s (10,000 queued shards, 10 projects) | mean claim (ms) |")
        print("|---|---|---|---|")
        for label, order in ORDERS.items():
            for claimers in (1, args.workers):
                rate, mean_ms = claim_rate(ctx, claimers, args.claim_seconds, order)
                print(f"| {label} | {claimers} | {rate:,.0f} | {mean_ms:.1f} |", flush=True)
        ctx.close()
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

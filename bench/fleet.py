"""Fleet simulation: N simulated GPU workers against one PostgreSQL, one Redis and one S3 server.

    .venv/bin/python bench/fleet.py [--workers 8,32,128] [--batches 2] [--requests 50000]
        [--processes 2] [--tokens-per-second 5000] [--max-tokens 250] [--prompt-tokens 200]
        [--shard-size 256] [--poll-connections 16] [--poll-seconds 10] [--pgbench-clients 8,32,64]

Each simulated worker runs the production worker's own code: a ``ShardRunner`` (its feeder claims
with ``leases.claim_next``, its lease monitor heartbeats, its result writer makes finished requests
durable in PostgreSQL, its finisher writes the shard's objects to S3, completes the shard and
finalizes the batch when it was the last), with one thing replaced: the engine is ``StandIn``,
which turns out ``--tokens-per-second`` output tokens a second (``--max-tokens`` a request, so
``tokens-per-second / max-tokens`` requests a second) and no model. The workers live in
``--processes`` child processes (threads inside each), as many real workers would hold their own
connections; each process shares one connection pool among its workers (a real worker opens its
own: see ``connections`` in the output).

The rest is the production set-up on this machine: a fresh PostgreSQL database (127.0.0.1:5432,
user postgres), a private redis-server as the broker, SeaweedFS (``weed mini``) as S3, and
``batchapi serve`` as the API (it validates the batches and enqueues their shards on Redis; the
simulated workers find them by polling the shards table, as ``batchapi worker`` does between
messages). For each N: ``--batches`` batches of ``--requests`` ``/v1/completions`` requests
(token-id prompts of ``--prompt-tokens``) are created from one uploaded file at once, and the
run lasts until the last one has completed. Printed, per N, over that window: shard claims/s,
result rows/s (and writes/s), heartbeats/s, each batch's finalisation seconds, the API's poll
p50/p99 under that load (``wrk`` when installed, else a closed loop of httpx clients on threads),
and PostgreSQL's own numbers: transactions/s from ``pg_stat_database``, rows written per table
from ``pg_stat_user_tables``, lock waits sampled from ``pg_locks`` (requests not granted) every
0.2 s with what the waiting backends wait to run and what blocks them, connections from
``pg_stat_activity``, and the CPU seconds of its backends. Then, after the last N, ``pgbench`` runs
the result writer's transaction alone on one batch (``--pgbench-clients``), with the batch row's
counts as today and with the counts on the shard row only: PostgreSQL's own ceiling for it.

    .venv/bin/python bench/fleet.py --workers 8,32 --requests 5000     # a quick look

Printed, never asserted: timings are noisy on a shared CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import httpx  # noqa: E402
from procs import answers, free_port, stat_fields, stop_group, wait_until  # noqa: E402

BIN = Path(sys.executable).parent / "batchapi"
MODEL = "smollm2-135m-instruct"
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TICK_SECONDS = 0.05  # the stand-in engine's step


# ---- the simulated worker ----


class StandIn:
    """The engine's place in a worker: requests in, results out, ``tokens_per_second`` output
    tokens a second over the running requests (up to ``max_num_seqs``, first come first served),
    every request its ``max_tokens`` long. What the shard runner asks of an engine front."""

    def __init__(self, tokens_per_second: float, max_num_seqs: int = 256, system_fingerprint: str | None = None):
        self.rate = tokens_per_second
        self.max_num_seqs = max_num_seqs
        self.system_fingerprint = system_fingerprint
        self._queue: deque[tuple] = deque()  # (request, future)
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-standin", daemon=True)
        self._thread.start()

    def submit_many(self, requests: list) -> list[Future]:
        futures = [Future() for _ in requests]
        with self._lock:
            self._queue.extend(zip(requests, futures, strict=True))
        return futures

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def num_waiting(self) -> int:
        return max(0, len(self._queue) - self.max_num_seqs)

    def num_running(self) -> int:
        return min(len(self._queue), self.max_num_seqs)

    def kv_usage(self) -> float:
        return self.num_running() / self.max_num_seqs

    def shutdown(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        budget, last = 0.0, time.monotonic()
        while not self._stop.wait(TICK_SECONDS):
            t = time.monotonic()
            budget, last = budget + self.rate * (t - last), t
            for request, future in self._finished(budget):
                budget -= request.params.max_tokens
                future.set_result(_result(request))  # the runner's callbacks run here, as on the engine thread
            if not self._queue:
                budget = 0.0  # an idle engine banks no tokens

    def _finished(self, budget: float) -> list[tuple]:
        out = []
        with self._lock:
            while self._queue:
                request, future = self._queue[0]
                if request.request_id in self._aborted:
                    self._queue.popleft()
                    self._aborted.discard(request.request_id)
                    continue
                if request.params.max_tokens > budget:
                    break
                budget -= request.params.max_tokens
                out.append(self._queue.popleft())
        return out


def _result(request):
    from batchapi.engine import GenerationResult
    from batchapi.engine.request import CompletionOutput

    n = request.params.max_tokens
    return GenerationResult(request.request_id, len(request.prompt_token_ids), 0,
                            [CompletionOutput(0, " word" * n, [1000 + i % 7 for i in range(n)], "length")])


class Counters:
    """The database work of a process's workers, counted by wrapping the functions they call."""

    WRAPPED = (("batchapi.batches.leases", "claim_next"), ("batchapi.batches.leases", "heartbeat"),
               ("batchapi.batches.request_results", "record"), ("batchapi.batches.leases", "complete"),
               ("batchapi.workers.shard_finisher", "finalize_batch"))

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.claimed = 0  # claim_next calls that returned a shard
        self.heartbeat_leases = 0  # leases extended
        self.rows = 0  # request-result rows recorded
        self.finalized: list[tuple[str, float]] = []  # (batch id, seconds) of the calls that ended a batch

    def install(self) -> None:
        import importlib

        for module_name, name in self.WRAPPED:
            module = importlib.import_module(module_name)
            setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name: str, function):
        def counted(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            elapsed = time.perf_counter() - start
            with self.lock:
                self.calls[name] = self.calls.get(name, 0) + 1
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
                if name == "claim_next" and result is not None:
                    self.claimed += 1
                elif name == "heartbeat":
                    self.heartbeat_leases += len(args[1])
                elif name == "record":
                    self.rows += sum(len(group.rows) for group in args[1])
                elif name == "finalize_batch" and result is not None:
                    self.finalized.append((args[1], elapsed))
            return result

        return counted

    def totals(self) -> dict:
        with self.lock:
            return {"calls": dict(self.calls), "seconds": dict(self.seconds), "claimed": self.claimed,
                    "heartbeat_leases": self.heartbeat_leases, "rows": self.rows, "finalized": list(self.finalized)}


class Fleet:
    """``workers`` shard runners in this process on ``ctx``, each with its own stand-in engine."""

    def __init__(self, ctx, workers: int, tokens_per_second: float, model: str, name: str = "fleet"):
        from batchapi.workers.codec import Codec
        from batchapi.workers.shard_runner import ShardRunner

        self.runners = [
            ShardRunner(ctx, StandIn(tokens_per_second), Codec(None, model), owner=f"{name}-{os.getpid()}-{i}")
            for i in range(workers)
        ]

    def __enter__(self) -> Fleet:
        for runner in self.runners:
            runner.start()
        return self

    def __exit__(self, *exc) -> None:
        threads = [threading.Thread(target=runner.shutdown) for runner in self.runners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def child_main(args) -> int:
    """A process of simulated workers: runs until its stdin closes, then prints its counters."""
    from batchapi.config import load_settings
    from batchapi.context import open_context
    from batchapi.models.registry import model_id

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    counters = Counters()
    counters.install()
    ctx = open_context(load_settings())
    with Fleet(ctx, args.workers, args.tokens_per_second, model_id(MODEL), name=f"fleet{args.index}"):
        print("ready", flush=True)
        sys.stdin.read()
    print(json.dumps(counters.totals()), flush=True)
    ctx.close()
    return 0


# ---- the measurement ----


def request_file(requests: int, prompt_tokens: int, max_tokens: int) -> bytes:
    """``/v1/completions`` lines of token-id prompts, sampled (no result cache entry), EOS ignored."""
    lines = []
    for i in range(requests):
        prompt = [100 + (i * 7 + j) % 40000 for j in range(prompt_tokens)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body},
                                separators=(",", ":")))
    return ("\n".join(lines) + "\n").encode()


def pg_counters(conn, database: str) -> dict:
    row = conn.execute("SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, deadlocks, "
                       "blks_read, blks_hit FROM pg_stat_database WHERE datname = %s", (database,)).fetchone()
    tables = {name: (ins, upd, hot, dele) for name, ins, upd, hot, dele in conn.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables")}
    return {"xact_commit": row[0], "xact_rollback": row[1], "tup_inserted": row[2], "tup_updated": row[3],
            "tup_deleted": row[4], "deadlocks": row[5], "blks_read": row[6], "blks_hit": row[7], "tables": tables}


class LockSampler(threading.Thread):
    """Every 0.2 s, in ``database``: the backends waiting on a lock (``pg_stat_activity``), what
    they wait to run and what the first backend blocking them is doing (``pg_blocking_pids``), the
    lock requests not granted (``pg_locks``) and the connections."""

    WAITING = """
        SELECT left(w.query, 48), b.state, left(b.query, 48)
        FROM pg_stat_activity w
        LEFT JOIN pg_stat_activity b ON b.pid = (pg_blocking_pids(w.pid))[1]
        WHERE w.datname = %s AND w.wait_event_type = 'Lock'"""

    def __init__(self, url: str, database: str):
        super().__init__(daemon=True)
        self.url, self.database = url, database
        self.stopping = threading.Event()
        self.samples: list[tuple[int, int, int]] = []  # (backends waiting, lock requests not granted, connections)
        self.waits: dict[tuple, int] = {}  # (waiting query, blocker's state, blocker's query) -> samples

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stopping.wait(0.2):
                waiting = conn.execute(self.WAITING, (self.database,)).fetchall()
                for row in waiting:
                    self.waits[row] = self.waits.get(row, 0) + 1
                ungranted = conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0]
                conns = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                                     (self.database,)).fetchone()[0]
                self.samples.append((len(waiting), ungranted, conns))

    def summary(self) -> dict:
        if not self.samples:
            return {"samples": 0}
        waiting = [s[0] for s in self.samples]
        top = sorted(self.waits.items(), key=lambda kv: -kv[1])[:3]
        return {"samples": len(waiting), "waiting_mean": round(sum(waiting) / len(waiting), 2),
                "waiting_max": max(waiting), "samples_with_waits": sum(1 for w in waiting if w),
                "ungranted_max": max(s[1] for s in self.samples), "connections_max": max(s[2] for s in self.samples),
                "top_waits": [{"waits_to": k[0], "blocker_state": k[1], "blocker_query": k[2], "samples": v}
                              for k, v in top]}


def backend_cpu_seconds(database: str) -> float:
    """CPU seconds of the live PostgreSQL backends connected to ``database`` (their titles name it)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            title = Path(f"/proc/{entry}/cmdline").read_bytes()
            if not title.startswith(b"postgres: ") or f" {database} ".encode() not in title:
                continue
            fields = stat_fields(entry)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy (not idle or iowait) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def poll_latency(base: str, path: str, connections: int, seconds: float) -> dict:
    """The poll's rate and latency under the fleet's load: wrk when installed, else a closed loop
    of ``connections`` keep-alive httpx clients on threads (its own CPU counts against the API's)."""
    wrk = shutil.which("wrk")
    if wrk:
        out = subprocess.run([wrk, "-t", "2", "-c", str(connections), "-d", f"{seconds:g}s", "--latency", base + path],
                             capture_output=True, text=True, check=True).stdout
        percent = dict(re.findall(r"^\s+(\d+)%\s+([\d.]+\w+)", out, re.M))
        rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
        non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        return {"client": "wrk", "rate": rate, "p50_ms": _ms(percent["50"]), "p99_ms": _ms(percent["99"]),
                "non_2xx": int(non2xx.group(1)) if non2xx else 0}
    latencies: list[float] = []
    failed = [0]
    stop_at = time.perf_counter() + seconds

    def loop() -> None:
        with httpx.Client(base_url=base, timeout=30) as http:
            while (sent := time.perf_counter()) < stop_at:
                status = http.get(path).status_code
                latencies.append(time.perf_counter() - sent)
                failed[0] += status != 200

    threads = [threading.Thread(target=loop) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies.sort()
    n = len(latencies)
    return {"client": "httpx threads", "rate": n / seconds, "p50_ms": 1000 * latencies[n // 2],
            "p99_ms": 1000 * latencies[min(n - 1, int(n * 0.99))], "non_2xx": failed[0]}


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


class Stack:
    """PostgreSQL (a fresh database), a private Redis, SeaweedFS and `batchapi serve`."""

    def __init__(self, workdir: Path, args):
        self.workdir, self.args = workdir, args
        self.stack = ExitStack()

    def __enter__(self) -> Stack:
        from tests.utils import services

        self.pg_url = self.stack.enter_context(services.fresh_database("batchapi_fleet"))
        self.database = self.pg_url.rsplit("/", 1)[1]
        s3 = self.stack.enter_context(services.seaweedfs(self.workdir / "seaweedfs", bucket="fleet"))
        redis_port, api_port = free_port(), free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
        self.env.update(s3.env("fleet"))
        self.env.update({
            "BATCHAPI_DATA_DIR": str(self.workdir / "data"), "BATCHAPI_DATABASE_URL": self.pg_url,
            "BATCHAPI_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0", "BATCHAPI_PORT": str(api_port),
            "BATCHAPI_HOST": "127.0.0.1", "BATCHAPI_AUTH_REQUIRED": "false", "BATCHAPI_ACCESS_LOG": "false",
            "BATCHAPI_SHARD_SIZE": str(self.args.shard_size), "BATCHAPI_RESULT_CACHE": "false",
        })
        self.base = f"http://127.0.0.1:{api_port}"
        self.procs: list[subprocess.Popen] = []
        self.stack.callback(self._stop)
        self._spawn("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                              "--appendonly", "no", "--dir", str(self.workdir)])
        subprocess.run([str(BIN), "db", "upgrade"], env=self.env, check=True, capture_output=True)
        api = self._spawn("api", [str(BIN), "serve"])
        wait_until(lambda: api.poll() is None and answers(self.base + "/health"), 120, "batchapi serve")
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def _spawn(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(argv, env=self.env, stdout=kwargs.pop("stdout", log), stderr=log,
                                start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def _stop(self) -> None:
        for proc in reversed(self.procs):
            stop_group(proc)

    def workers(self, n: int, processes: int) -> list[subprocess.Popen]:
        """``n`` simulated workers in up to ``processes`` child processes, each ready."""
        counts = [n // processes + (i < n % processes) for i in range(processes) if n // processes + (i < n % processes)]
        env = dict(self.env, BATCHAPI_DB_POOL_SIZE=str(max(4, min(40, 3 * max(counts)))))
        children = []
        for index, count in enumerate(counts):
            argv = [sys.executable, __file__, "child", "--workers", str(count), "--index", str(index),
                    "--tokens-per-second", str(self.args.tokens_per_second)]
            log = open(self.workdir / f"workers{index}.log", "ab")  # noqa: SIM115 - the child keeps it
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                    start_new_session=True, text=True)
            children.append(proc)
        for proc in children:
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"a worker process did not start: {line!r} (see workers*.log)"
        return children


def run_fleet(stack: Stack, n: int, file_id: str, args) -> dict:
    import psycopg

    children = stack.workers(n, min(args.processes, n))
    admin = psycopg.connect(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{stack.database}", autocommit=True)
    sampler = LockSampler(PG_ADMIN_URL, stack.database)
    try:
        before = pg_counters(admin, stack.database)
        pg_cpu, busy = backend_cpu_seconds(stack.database), machine_busy_seconds()
        sampler.start()
        start = time.perf_counter()
        with httpx.Client(base_url=stack.base, timeout=120) as http:
            ids = [http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}).raise_for_status().json()["id"]
                   for _ in range(args.batches)]
            poll = None
            ended: dict[str, dict] = {}
            while len(ended) < len(ids):
                time.sleep(1.0)
                for bid in ids:
                    if bid not in ended:
                        batch = http.get(f"/v1/batches/{bid}").json()
                        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                            ended[bid] = batch
                running = [bid for bid in ids if bid not in ended]
                done = sum(b["request_counts"]["completed"] for b in ended.values())
                if poll is None and running and time.perf_counter() - start > args.poll_after:
                    poll = poll_latency(stack.base, f"/v1/batches/{running[0]}", args.poll_connections,
                                        args.poll_seconds)
                if time.perf_counter() - start > args.timeout:
                    raise SystemExit(f"N={n}: {len(ended)} of {len(ids)} batches ended after {args.timeout} s "
                                     f"({done} requests completed)")
        window = time.perf_counter() - start
        sampler.stopping.set()
        sampler.join()
        pg_cpu, busy = backend_cpu_seconds(stack.database) - pg_cpu, machine_busy_seconds() - busy
        time.sleep(0.6)  # PostgreSQL flushes its statistics at most every 0.5 s
        after = pg_counters(admin, stack.database)
    finally:
        sampler.stopping.set()
        admin.close()
        totals = []
        for proc in children:
            out, _ = proc.communicate("", timeout=300)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            totals.append(json.loads(lines[-1]) if lines else {})
    return {"n": n, "window": window, "batches": ended, "poll": poll, "pg_before": before, "pg_after": after,
            "pg_cpu": pg_cpu, "busy": busy, "locks": sampler.summary(), "workers": totals}


# the result writer's transaction (``request_results.record``) as pgbench runs it, ROWS rows of
# LINE_BYTES each on one of the batch's shards a client: as today, with the batch row's counts,
# and without them (the counts on the shard row the transaction updates anyway)
PGBENCH_ROWS, LINE_BYTES = 16, 1200
PGBENCH_SCRIPT = """\\set s :client_id % {shards}
\\set q random(1, 100000000)
BEGIN;
UPDATE shards SET lease_expires_at = lease_expires_at + 1{shard_counts} WHERE batch_id = '{batch}' AND index = :s;
INSERT INTO request_results (shard_id, seq, succeeded, line, input_tokens, cached_tokens, output_tokens, attempt)
  SELECT id, :q * 20 + g, true, convert_to(repeat('x', {line}), 'UTF8'), 200, 0, 250, 1
  FROM shards, generate_series(1, {rows}) g WHERE batch_id = '{batch}' AND index = :s ON CONFLICT DO NOTHING;
{batch_counts}COMMIT;
"""
BATCH_COUNTS = ("UPDATE batches SET request_completed = request_completed + {rows}, "
                "output_tokens = output_tokens + {rows} * 250 WHERE id = '{batch}';\n")


def pgbench_writes(stack: Stack, batch_id: str, shards: int, clients: list[int], seconds: float) -> list[str]:
    """PostgreSQL's own rate of result writes on one batch (pgbench, a C client: no Python in the
    way), with the batch row updated in every transaction and without."""
    import psycopg

    out = []
    for name, batch_counts, shard_counts in (
            ("batch row counts (today)", BATCH_COUNTS.format(rows=PGBENCH_ROWS, batch=batch_id), ""),
            ("shard row counts only", "", f", completed_count = completed_count + {PGBENCH_ROWS}")):
        script = stack.workdir / "pgbench.sql"
        script.write_text(PGBENCH_SCRIPT.format(shards=shards, batch=batch_id, line=LINE_BYTES, rows=PGBENCH_ROWS,
                                                batch_counts=batch_counts, shard_counts=shard_counts))
        for c in clients:
            run = subprocess.run(["pgbench", "-n", "-h", "127.0.0.1", "-U", "postgres", "-M", "prepared", "-f",
                                  str(script), "-c", str(c), "-j", "2", "-T", f"{seconds:g}", stack.database],
                                 capture_output=True, text=True)
            tps = re.search(r"tps = ([\d.]+)", run.stdout)
            latency = re.search(r"latency average = ([\d.]+) ms", run.stdout)
            if tps is None:
                out.append(f"  pgbench {name}, {c} clients: failed: {(run.stderr or run.stdout).strip()[-200:]}")
                continue
            out.append(f"  pgbench {name}, {c} clients: {float(tps.group(1)):.0f} writes/s = "
                       f"{float(tps.group(1)) * PGBENCH_ROWS:.0f} result rows/s, latency {latency.group(1)} ms")
            with psycopg.connect(stack.pg_url, autocommit=True) as conn:
                conn.execute("DELETE FROM request_results")
    return out


def report(result: dict, args) -> str:
    n, window, workers = result["n"], result["window"], result["workers"]

    def total(key: str, sub: str | None = None) -> float:
        return sum((w.get(key, {}).get(sub, 0) if sub else w.get(key, 0)) for w in workers)

    b, a = result["pg_before"], result["pg_after"]
    xacts = a["xact_commit"] - b["xact_commit"]
    requests = sum(batch["request_counts"]["total"] for batch in result["batches"].values())
    completed = sum(batch["request_counts"]["completed"] for batch in result["batches"].values())
    finalized = sorted(seconds for w in workers for _, seconds in w.get("finalized", []))
    poll = result["poll"] or {}
    tables = {name: tuple(x - y for x, y in zip(a["tables"][name], b["tables"].get(name, (0, 0, 0, 0)), strict=True))
              for name in a["tables"]}
    busiest = sorted(tables.items(), key=lambda kv: -sum(kv[1]))[:4]
    rate = args.tokens_per_second / args.max_tokens
    lines = [
        f"N={n}: {len(result['batches'])} batches x {requests // max(1, len(result['batches']))} requests, "
        f"{completed} completed in {window:.1f} s = {completed / window:.0f} requests/s "
        f"(the stand-ins' ceiling: {n * rate:.0f}/s)",
        f"  claims/s {total('claimed') / window:.1f} (claim_next calls/s {total('calls', 'claim_next') / window:.1f}, "
        f"{1000 * total('seconds', 'claim_next') / max(1, total('calls', 'claim_next')):.1f} ms each)",
        f"  result rows/s {total('rows') / window:.0f} in {total('calls', 'record') / window:.1f} writes/s "
        f"({1000 * total('seconds', 'record') / max(1, total('calls', 'record')):.1f} ms each); "
        f"shard completes/s {total('calls', 'complete') / window:.2f} "
        f"({1000 * total('seconds', 'complete') / max(1, total('calls', 'complete')):.0f} ms each)",
        f"  heartbeats/s {total('calls', 'heartbeat') / window:.1f} calls, "
        f"{total('heartbeat_leases') / window:.1f} leases extended",
        "  finalisation: " + (", ".join(f"{s:.2f} s" for s in finalized) or "none seen"),
        f"  poll {poll.get('client', '-')}: {poll.get('rate', 0):.0f}/s at {args.poll_connections} connections, "
        f"p50 {poll.get('p50_ms', 0):.1f} ms, p99 {poll.get('p99_ms', 0):.1f} ms, non-2xx {poll.get('non_2xx', 0)}",
        f"  PostgreSQL: {xacts / window:.0f} commits/s, {(a['xact_rollback'] - b['xact_rollback']) / window:.1f} "
        f"rollbacks/s, {(a['tup_inserted'] - b['tup_inserted']) / window:.0f} rows inserted/s, "
        f"{(a['tup_updated'] - b['tup_updated']) / window:.0f} updated/s, "
        f"{(a['tup_deleted'] - b['tup_deleted']) / window:.0f} deleted/s, deadlocks {a['deadlocks'] - b['deadlocks']}; "
        f"backends' CPU {result['pg_cpu']:.1f} s = {result['pg_cpu'] / window:.2f} cores "
        f"(machine busy {result['busy'] / window:.2f} of {os.cpu_count()} cores)",
        "  busiest tables (ins, upd, hot upd, del): " + ", ".join(f"{name} {t}" for name, t in busiest),
        f"  locks: {json.dumps(result['locks'])}",
    ]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        ap = argparse.ArgumentParser()
        ap.add_argument("child")
        ap.add_argument("--workers", type=int, required=True)
        ap.add_argument("--index", type=int, default=0)
        ap.add_argument("--tokens-per-second", type=float, required=True)
        return child_main(ap.parse_args())
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="8,32,128", help="comma list of fleet sizes N")
    ap.add_argument("--batches", type=int, default=2, help="batches created at once for each N")
    ap.add_argument("--requests", type=int, default=50_000, help="requests a batch")
    ap.add_argument("--processes", type=int, default=2, help="child processes holding the workers")
    ap.add_argument("--tokens-per-second", type=float, default=5000, help="each stand-in engine's output tokens/s")
    ap.add_argument("--max-tokens", type=int, default=250, help="output tokens a request")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--poll-connections", type=int, default=16)
    ap.add_argument("--poll-seconds", type=float, default=10)
    ap.add_argument("--poll-after", type=float, default=15, help="start the poll measurement this many s in")
    ap.add_argument("--timeout", type=float, default=1800, help="give up on an N after this many seconds")
    ap.add_argument("--pgbench-clients", default="8,32,64",
                    help="then the result writes alone through pgbench at these client counts ('' skips)")
    ap.add_argument("--pgbench-seconds", type=float, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the temporary dir (the logs)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="batchapi-fleet-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        with Stack(workdir, args) as stack, httpx.Client(base_url=stack.base, timeout=300) as http:
            data = request_file(args.requests, args.prompt_tokens, args.max_tokens)
            file_id = http.post("/v1/files", files={"file": ("fleet.jsonl", data)},
                                data={"purpose": "batch"}).raise_for_status().json()["id"]
            print(f"{args.batches} batches of {args.requests} /v1/completions requests ({len(data) / 1e6:.1f} MB, "
                  f"{args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens each), shards of "
                  f"{args.shard_size}; each simulated worker {args.tokens_per_second:g} output tokens/s = "
                  f"{args.tokens_per_second / args.max_tokens:g} requests/s; workers in {args.processes} processes",
                  flush=True)
            last = None
            for n in (int(x) for x in args.workers.split(",") if x):
                last = run_fleet(stack, n, file_id, args)
                print(report(last, args), flush=True)
            if args.pgbench_clients and last is not None and shutil.which("pgbench"):
                batch_id = next(iter(last["batches"]))
                shards = -(-args.requests // args.shard_size)
                print(f"the result writer's transaction alone ({PGBENCH_ROWS} rows of {LINE_BYTES} bytes on one of "
                      f"the {shards} shards of one batch a client), pgbench {args.pgbench_seconds:g} s each:")
                clients = [int(x) for x in args.pgbench_clients.split(",")]
                print("\n".join(pgbench_writes(stack, batch_id, shards, clients, args.pgbench_seconds)), flush=True)
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Polling load on both deployments, and what polling does to the embedded default's engine.

Polls: `wrk` (Debian's C load generator, installed with apt-get when missing, so that the client's
own CPU does not decide the figure) with C keep-alive connections on `GET /v1/batches/{id}`, as fast
as they go (a closed loop) and paced to a target rate (each wrk thread sends its share of the
rate on a fixed schedule, whatever the answers' latency), printing polls/s, p50/p99/max latency, non-200 answers and the API's CPU per poll:

1. the embedded default: `batchapi serve` with no configuration (SQLite, the worker in a child
   process, the access log on), polled on a finished batch (the engine idle);
2. the production API: `batchapi serve` on a fresh PostgreSQL database (made and dropped at
   `--pg-admin-url`) with a private redis-server as the broker (so it runs the API alone), polled
   on a batch `in_progress` while a writer thread stands in for a worker, committing progress to its
   row 10 times a second.

The engine under polling (embedded default only): the wall time of one batch (`--lines` requests
of `--max-tokens` tokens, prompts new to the result cache) unloaded, while C connections poll it
at `--slow-rate` polls/s in total, and while they poll as fast as they can; each loaded time over
the unloaded one of the same round is the ratio printed; `--peer` measures the same with the worker
on threads of the API process (as it ran before it had a process of its own). `--repeat` runs more
rounds, since the cores are shared.

    .venv/bin/python bench/poll_load.py                              # both deployments, 1 round
    .venv/bin/python bench/poll_load.py --repeat 2 --only embedded --peer
    .venv/bin/python bench/poll_load.py --profile poll.txt           # py-spy stacks of the embedded API
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
from procs import answers, cpu_model, cpu_seconds, free_port, stat_fields, stop_group, wait_until

BIN = Path(sys.executable).parent / "batchapi"
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TERMINAL = {"completed", "failed", "expired", "cancelled"}
# wrk's summary as one JSON line. A paced run keeps each wrk thread to its share of the rate on a
# fixed schedule (a poll's slot is the previous slot plus the period; it waits only until its slot),
# so the offered rate does not fall as the answers slow, as a fixed pause after each answer would.
WRK_SCRIPT = """
local period = tonumber(os.getenv("POLL_PERIOD_MS") or "0")
if period > 0 then
  local ffi = require("ffi")
  ffi.cdef[[ typedef struct { long tv_sec; long tv_nsec; } poll_timespec;
             int clock_gettime(int clk_id, poll_timespec *tp); ]]
  local ts = ffi.new("poll_timespec")
  local function now_ms()
    ffi.C.clock_gettime(1, ts)  -- CLOCK_MONOTONIC
    return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
  end
  local slot = nil
  delay = function()
    local t = now_ms()
    slot = (slot == nil or slot < t - 1000) and t or slot + period  -- a slot missed by a second is dropped
    return math.max(0, math.floor(slot - t))
  end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"count": %d, "seconds": %.3f, "non_2xx": %d, "socket_errors": %d, '
    .. '"p50_ms": %.2f, "p99_ms": %.2f, "max_ms": %.2f}\\n', summary.requests, summary.duration / 1e6,
    e.status, e.connect + e.read + e.write + e.timeout, latency:percentile(50) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000))
end
"""


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group (Linux)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(entry)
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy (not idle or iowait) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


# the service under test


class Processes:
    def __init__(self, workdir: Path, env: dict[str, str]):
        self.workdir, self.env, self.procs = workdir, env, {}

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(args, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def stop(self, name: str) -> None:
        stop_group(self.procs.pop(name))

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)




def upload_batch(http: httpx.Client, lines: int, max_tokens: int, tag: str) -> str:
    """Upload a file of ``lines`` chat requests (prompts tagged, so that no earlier run's results
    answer them) and create a batch of it; returns its id."""
    data = "".join(
        json.dumps({"custom_id": f"poll-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "smollm2-135m-instruct", "max_tokens": max_tokens,
                             "messages": [{"role": "user", "content": f"Run {tag}: say {i} in words."}]}}) + "\n"
        for i in range(lines)
    ).encode()
    upload = http.post("/v1/files", files={"file": ("poll.jsonl", data)}, data={"purpose": "batch"})
    upload.raise_for_status()
    batch = http.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                           "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    batch.raise_for_status()
    return batch.json()["id"]


def wait_status(http: httpx.Client, batch_id: str, done, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not done(batch := http.get(f"/v1/batches/{batch_id}").json()):
        if time.monotonic() > deadline:
            raise SystemExit(f"batch {batch_id} still {batch['status']} after {timeout:.0f} s")
        time.sleep(0.25)
    return batch


class ProgressWriter(threading.Thread):
    """Stands in for a worker: commits progress to the batch row every ``interval`` seconds."""

    def __init__(self, database_url: str, batch_id: str, interval: float = 0.1):
        super().__init__(daemon=True)
        self.database_url, self.batch_id, self.interval = database_url, batch_id, interval
        self.stopping, self.writes = threading.Event(), 0

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.database_url, autocommit=True) as conn:
            while not self.stopping.wait(self.interval):
                conn.execute(
                    "UPDATE batches SET request_completed = MOD(request_completed + 1, request_total) WHERE id = %s",
                    (self.batch_id,),
                )
                self.writes += 1




# wrk


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found is None:  # Debian's package, as the Makefile installs chromium
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, capture_output=True)
        found = shutil.which("wrk")
    assert found, "wrk is not installed (apt-get install wrk)"
    return found


class Wrk:
    """One wrk run against ``url`` (started now; ``result`` waits for its summary)."""

    def __init__(self, workdir: Path, url: str, key: str, connections: int, seconds: float,
                 rate: float | None = None):
        script = workdir / "poll.lua"
        script.write_text(WRK_SCRIPT)
        threads = min(connections, 2)
        period = 0 if rate is None else 1000 * threads / rate  # ms between one thread's polls
        self.proc = subprocess.Popen(
            [ensure_wrk(), "-t", str(threads), "-c", str(connections), "-d", f"{seconds:.0f}s",
             "--timeout", "10s", "-s", str(script), "-H", f"Authorization: Bearer {key}", url],
            env=dict(os.environ, POLL_PERIOD_MS=f"{period:.4f}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # wrk stops and prints its summary

    def result(self) -> dict:
        out, err = self.proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"wrk printed no summary: {out} {err}"
        result = json.loads(lines[-1])
        result["rate"] = result["count"] / result["seconds"]
        return result


def polls(workdir: Path, url: str, key: str, connections: int, seconds: float, pgid: int,
          rate: float | None = None) -> dict:
    """wrk for ``seconds`` (after 2 s unmeasured), with the API's CPU per poll."""
    Wrk(workdir, url, key, connections, 2, rate).result()
    cpu, busy = group_cpu_seconds(pgid), machine_busy_seconds()
    result = Wrk(workdir, url, key, connections, seconds, rate).result()
    result["api_cpu_ms"] = 1000 * (group_cpu_seconds(pgid) - cpu) / max(result["count"], 1)
    result["machine_cpu_s"] = machine_busy_seconds() - busy
    return result


# the deployments


def env_for(workdir: Path, port: int, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    env.update(BATCHAPI_DATA_DIR=str(workdir / "data"), BATCHAPI_PORT=str(port), **settings)
    return env


def api_key(env: dict[str, str]) -> str:
    subprocess.run([str(BIN), "db", "upgrade"], env=env, check=True, capture_output=True)
    made = subprocess.run([str(BIN), "keys", "create", "--project", "bench"], env=env, check=True,
                          capture_output=True, text=True)
    return made.stdout.strip().splitlines()[-1]


# the peer of the embedded default: its worker on threads of the API process, as before it had a
# process of its own (``EmbeddedWorker``)
IN_THREADS = ("import logging; from batchapi import logs; from batchapi.api.main import serve; "
              "from batchapi.config import load_settings; from batchapi.workers.embedded import EmbeddedWorker; "
              "logs.configure('text', logging.INFO); worker = EmbeddedWorker(); "
              "serve(load_settings(), dispatcher=worker, hook=worker.run, sweep_shards=True)")


def serve(procs: Processes, env: dict[str, str], workdir: Path, port: int,
          threads: bool = False) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-c", IN_THREADS] if threads else [str(BIN), "serve"]
    api = procs.spawn("api", *command, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(base + "/health"), 180, f"the API (see {workdir}/api.log)")
    return api, base


def embedded_round(args, workdir: Path, http: httpx.Client, base: str, key: str, pgid: int, round_: int) -> dict:
    """The batch time unloaded, under ``--slow-rate`` polls/s and under as many as wrk gets; then
    the polls as fast as they go and at ``--rate`` on a running batch."""
    out = {}
    for name, rate in (("unloaded", 0), ("slow", args.slow_rate), ("max", None)):
        batch_id = upload_batch(http, args.lines, args.max_tokens, f"{round_}-{name}-{uuid.uuid4().hex[:6]}")
        start, api_cpu = time.perf_counter(), group_cpu_seconds(pgid)
        load = None if rate == 0 else Wrk(workdir, f"{base}/v1/batches/{batch_id}", key, args.connections, 3600, rate)
        batch = wait_status(http, batch_id, lambda b: b["status"] in TERMINAL, 1800)
        out[f"batch_{name}_s"] = seconds = time.perf_counter() - start
        assert batch["status"] == "completed", batch
        # where the time went: validating, running (the engine), finalizing
        out[f"batch_{name}_phases"] = [batch["in_progress_at"] - batch["created_at"],
                                       batch["finalizing_at"] - batch["in_progress_at"],
                                       batch["completed_at"] - batch["finalizing_at"]]
        if load is not None:
            # the cores the API and the load client took while the batch ran: the rest was the engine's to use
            taken = group_cpu_seconds(pgid) - api_cpu + cpu_seconds(load.proc.pid)
            load.stop()
            out[f"batch_{name}_polls"] = load.result()["rate"]
            out[f"batch_{name}_taken"] = taken / seconds
    # the polls on the last batch, finished: the API's own rate, the engine idle (the loaded batch
    # times above show the two together)
    url = f"{base}/v1/batches/{batch_id}"
    out["max"] = polls(workdir, url, key, args.connections, args.seconds, pgid)
    out["paced"] = polls(workdir, url, key, args.connections, args.seconds, pgid, args.rate)
    return out


def run_embedded(args, threads: bool = False) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="batchapi-poll-embedded-"))
    port = free_port()
    env = env_for(workdir, port)
    procs = Processes(workdir, env)
    try:
        key = api_key(env)
        api, base = serve(procs, env, workdir, port, threads)
        spy = None
        if args.profile is not None and not threads:  # py-spy (pip install py-spy): where the API's and the worker's GIL goes
            spy = subprocess.Popen([shutil.which("py-spy") or "py-spy", "record", "--pid", str(api.pid),
                                    "--subprocesses", "--format", "raw", "--gil", "--rate", "200", "--duration",
                                    "30", "--output", str(args.profile)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        rounds = []
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            # the first batch waits for the worker to load the model: not a measurement
            warm = upload_batch(http, 2, args.max_tokens, f"warm-{uuid.uuid4().hex[:6]}")
            wait_status(http, warm, lambda b: b["status"] in TERMINAL, 600)
            for round_ in range(args.repeat):
                rounds.append(embedded_round(args, workdir, http, base, key, api.pid, round_))
                print(f"embedded ({'threads' if threads else 'child process'}) round {round_ + 1}: "
                      f"{json.dumps(rounds[-1])}", flush=True)
        if spy is not None:
            spy.wait()
        return rounds
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def run_production(args) -> list[dict]:
    import psycopg

    workdir = Path(tempfile.mkdtemp(prefix="batchapi-poll-production-"))
    db_name = f"batchapi_poll_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(args.pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    database_url = args.pg_admin_url.rsplit("/", 1)[0] + "/" + db_name
    redis_port, port = free_port(), free_port()
    env = env_for(workdir, port, BATCHAPI_DATABASE_URL=database_url,
                  BATCHAPI_BROKER_URL=f"redis://127.0.0.1:{redis_port}/0")
    procs = Processes(workdir, env)
    writer = None
    try:
        procs.spawn("redis", "redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                    "--appendonly", "no", "--dir", str(workdir))
        key = api_key(env)
        api, base = serve(procs, env, workdir, port)
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            batch_id = upload_batch(http, 64, 16, uuid.uuid4().hex[:6])
            wait_status(http, batch_id, lambda b: b["status"] == "in_progress", 300)
        writer = ProgressWriter(database_url, batch_id)
        writer.start()
        url = f"{base}/v1/batches/{batch_id}"
        return [{"max": polls(workdir, url, key, args.connections, args.seconds, api.pid),
                 "paced": polls(workdir, url, key, args.connections, args.seconds, api.pid, args.rate)}
                for _ in range(args.repeat)]
    finally:
        if writer is not None:
            writer.stopping.set()
            writer.join()
        procs.stop_all()
        with psycopg.connect(args.pg_admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        shutil.rmtree(workdir, ignore_errors=True)


# the report


def poll_row(deployment: str, load: str, connections: int, r: dict) -> str:
    return (f"| {deployment} | {load} | {connections} | {r['rate']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['max_ms']:.0f} | {r['non_2xx'] + r['socket_errors']} | {r['api_cpu_ms']:.2f} | "
            f"{r['machine_cpu_s'] / r['seconds']:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["embedded", "production"], default=None)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds of each poll run")
    parser.add_argument("--rate", type=float, default=1000.0, help="polls/s in total of the paced run")
    parser.add_argument("--slow-rate", type=float, default=200.0, help="polls/s in total while the batch runs")
    parser.add_argument("--lines", type=int, default=96, help="requests in the timed batch")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1, help="rounds")
    parser.add_argument("--peer", action="store_true",
                        help="the embedded default again with its worker on threads of the API process (as before)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy collapsed stacks (GIL holders) of the embedded serve and its worker, 30 s")
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL, help="a fresh database is made and dropped here")
    args = parser.parse_args()
    ensure_wrk()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still stops its servers

    embedded = run_embedded(args) if args.only != "production" else []
    in_threads = run_embedded(args, threads=True) if args.only != "production" and args.peer else []
    production = run_production(args) if args.only != "embedded" else []
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; wrk, {args.connections} connections, {args.seconds:.0f} s per "
          f"poll run; paced: {args.rate:.0f} polls/s offered")
    print("| deployment | load | conns | polls/s | p50 ms | p99 ms | max ms | errors | API CPU ms/poll | "
          "machine cores busy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rounds in (("embedded default", embedded), ("embedded, worker on threads (peer)", in_threads),
                         ("production API", production)):
        for r in rounds:
            print(poll_row(name, "as fast as it goes", args.connections, r["max"]))
            print(poll_row(name, f"paced at {args.rate:.0f}/s", args.connections, r["paced"]))
    if embedded:
        print(f"\nthe embedded default's batch of {args.lines} requests x {args.max_tokens} tokens: unloaded, while "
              f"{args.connections} connections poll it at {args.slow_rate:.0f}/s, and as fast as they go (ratio: "
              f"over the unloaded time of the same round; API + wrk: the cores those took meanwhile; bound: the "
              f"ratio at which the engine runs at the share of the {os.cpu_count()} cores they left it)")
        print("| worker | round | unloaded s | polls/s | s | ratio | polls/s | API + wrk cores | s | ratio | bound |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, rounds in (("child process", embedded), ("threads of the API (peer)", in_threads)):
            for i, r in enumerate(rounds):
                base = r["batch_unloaded_s"]
                cores = os.cpu_count()
                # the peer's process holds its engine too: what the API took alone is not known there
                taken, bound = ("-", "-") if rounds is in_threads else (
                    f"{r['batch_max_taken']:.2f}", f"{cores / max(cores - r['batch_max_taken'], 0.01):.2f}")
                print(f"| {name} | {i + 1} | {base:.1f} | {r['batch_slow_polls']:,.0f} | {r['batch_slow_s']:.1f} | "
                      f"{r['batch_slow_s'] / base:.2f} | {r['batch_max_polls']:,.0f} | {taken} | "
                      f"{r['batch_max_s']:.1f} | {r['batch_max_s'] / base:.2f} | {bound} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

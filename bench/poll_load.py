"""Polling load: many keep-alive clients polling `GET /v1/batches/{id}` while a batch runs.

The production shape on this machine: a fresh PostgreSQL database, a private redis-server as the
broker (so `batchapi serve` runs the API alone), an API key, and one batch uploaded, validated and
`in_progress` through the API. No GPU worker runs; a writer thread stands in for one, committing
progress to the batch row 10 times a second, so polls read a row that is being written.

Each measurement is a closed loop of C connections (a small asyncio HTTP/1.1 client in its own
process, uvloop when installed): each sends a request, waits for the whole response, and sends the
next. It prints polls/s, p50/p99 latency, non-200 answers and CPU seconds of the API processes, the
load generator (it shares the cores) and the machine, for three targets measured in the same run:

1. the poll, `GET /v1/batches/{id}` with `Authorization: Bearer KEY`;
2. `GET /v1/models` on the same server with the same key: the app and its authentication, no
   batch query (what the poll costs beyond it is its own query and serialization);
3. the peer: a trivial FastAPI app under the same uvicorn (same processes, no access log)
   returning the poll's own JSON bytes as a constant. poll/peer is what the route costs over the
   framework floor.

    .venv/bin/python bench/poll_load.py                                 # 64 connections, 10 s each
    .venv/bin/python bench/poll_load.py --connections 64,200 --repeat 3 --serve-args "--workers 2"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
from procs import answers, free_port, stat_fields, stop_group, wait_until

BIN = Path(sys.executable).parent / "batchapi"
HERE = Path(__file__).resolve().parent
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"






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


def backend_cpu_seconds(database: str) -> float:
    """CPU seconds of the PostgreSQL backends connected to ``database`` (their titles name it)."""
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


# the load generator: `poll_load.py drive URL PATH CONNECTIONS SECONDS WARMUP [HEADER...]`


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; ``request`` sends and resolves with the status."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buffer[:end]).lower()
        start = head.find(b"content-length:")
        assert start >= 0, "the bench reads only responses with a Content-Length"
        line_end = head.find(b"\r\n", start)
        length = int(head[start + 15 : line_end if line_end >= 0 else len(head)])
        if len(self.buffer) < end + 4 + length:
            return
        del self.buffer[: end + 4 + length]
        waiter, self.waiter = self.waiter, None
        waiter.set_result(int(head[9:12]))

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def request(self, data: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter


async def _drive(host: str, port: int, request: bytes, connections: int, seconds: float, warmup: float) -> dict:
    loop = asyncio.get_running_loop()
    conns = [(await loop.create_connection(_Connection, host, port))[1] for _ in range(connections)]
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    begin = time.perf_counter()
    record_from, stop_at = begin + warmup, begin + warmup + seconds
    cpu = {}

    async def one(conn: _Connection) -> None:
        clock = time.perf_counter
        while (sent := clock()) < stop_at:
            status = await conn.request(request)
            if sent >= record_from:
                latencies.append(clock() - sent)
                statuses[status] = statuses.get(status, 0) + 1

    def mark(name: str) -> None:
        cpu[name] = time.process_time()

    loop.call_at(loop.time() + warmup, mark, "start")
    loop.call_at(loop.time() + warmup + seconds, mark, "stop")
    await asyncio.gather(*(one(c) for c in conns))
    for conn in conns:
        conn.transport.close()
    latencies.sort()
    n = len(latencies)
    return {
        "count": n, "rate": n / seconds, "statuses": statuses,
        "p50_ms": 1000 * latencies[n // 2] if n else None,
        "p99_ms": 1000 * latencies[min(n - 1, int(n * 0.99))] if n else None,
        "max_ms": 1000 * latencies[-1] if n else None,
        "driver_cpu_s": cpu.get("stop", time.process_time()) - cpu["start"],
    }


def drive_main(argv: list[str]) -> int:
    url, path, connections, seconds, warmup, *headers = argv
    host, port = url.removeprefix("http://").split(":")
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", *headers, "", ""]
    request = "\r\n".join(lines).encode()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    result = run(_drive(host, int(port), request, int(connections), float(seconds), float(warmup)))
    print(json.dumps(result))
    return 0


# the peer: `uvicorn --app-dir bench --factory poll_load:peer_app`


def peer_app():
    from fastapi import FastAPI, Response

    body = Path(os.environ["POLL_LOAD_PEER_BODY"]).read_bytes()
    app = FastAPI()

    @app.get("/v1/batches/{batch_id}")
    async def poll(batch_id: str) -> Response:
        return Response(body, media_type="application/json")

    return app


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




def start_batch(base: str, key: str, lines: int) -> dict:
    """Upload a small file and create a batch through the API; wait for it to be in_progress."""
    data = "".join(
        json.dumps({"custom_id": f"poll-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "smollm2-135m-instruct", "max_tokens": 16,
                             "messages": [{"role": "user", "content": f"Say {i}."}]}}) + "\n"
        for i in range(lines)
    ).encode()
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        upload = http.post("/v1/files", files={"file": ("poll.jsonl", data)}, data={"purpose": "batch"})
        upload.raise_for_status()
        batch = http.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                               "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        batch.raise_for_status()
        bid = batch.json()["id"]
        wait_until(lambda: http.get(f"/v1/batches/{bid}").json()["status"] != "validating", 120, "validation")
        batch = http.get(f"/v1/batches/{bid}").json()
    assert batch["status"] == "in_progress", batch
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


def database_counters(admin_url: str, name: str) -> tuple[int, int]:
    """PostgreSQL's count of sessions opened on a database and of its transactions, so far."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        sessions, xacts = conn.execute(
            "SELECT sessions, xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (name,)
        ).fetchone()
    return sessions, xacts


def measure(base: str, path: str, headers: list[str], connections: int, args, pgid: int,
            profile: Path | None = None) -> dict:
    spy = None
    if profile is not None:  # py-spy (pip install py-spy): where the server's processes hold the GIL
        spy = subprocess.Popen([str(BIN.parent / "py-spy"), "record", "--pid", str(pgid), "--subprocesses",
                                "--format", "raw", "--gil", "--rate", "200", "--duration", str(int(args.warmup + args.seconds)),
                                "--output", str(profile)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sessions, xacts = database_counters(args.pg_admin_url, args.db_name)
    busy, api_cpu, pg_cpu = machine_busy_seconds(), group_cpu_seconds(pgid), backend_cpu_seconds(args.db_name)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "drive", base, path, str(connections), str(args.seconds),
         str(args.warmup), *headers],
        check=True, capture_output=True, text=True,
    )
    result = json.loads(out.stdout)
    # the API's and the machine's CPU over the whole driver run (warm-up included), scaled to the window
    share = args.seconds / (time.perf_counter() - start)
    result["api_cpu_s"] = (group_cpu_seconds(pgid) - api_cpu) * share
    result["machine_cpu_s"] = (machine_busy_seconds() - busy) * share
    result["pg_cpu_s"] = (backend_cpu_seconds(args.db_name) - pg_cpu) * share
    time.sleep(0.6)  # PostgreSQL flushes its statistics at most every 0.5 s
    sessions_after, xacts_after = database_counters(args.pg_admin_url, args.db_name)
    # over the whole driver run; the progress writer adds its 10 transactions a second
    result["pg_sessions"] = sessions_after - sessions
    result["pg_xacts_per_request"] = (xacts_after - xacts) / max(1, result["count"] * (1 + args.warmup / args.seconds))
    if spy is not None:
        spy.wait()
        print(f"profile of the server (py-spy collapsed stacks): {profile}")
    return result


def row(name: str, connections: int, r: dict) -> str:
    errors = sum(n for status, n in r["statuses"].items() if int(status) != 200)
    return (f"| {name} | {connections} | {r['rate']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['max_ms']:.0f} | {errors} | {r['api_cpu_s']:.1f} | {1000 * r['api_cpu_s'] / r['count']:.2f} | "
            f"{r['driver_cpu_s']:.1f} | {r['pg_cpu_s']:.1f} | "
            f"{r['machine_cpu_s']:.1f} | {r['pg_sessions']} | {r['pg_xacts_per_request']:.1f} |")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "drive":
        return drive_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", default="64", help="comma-separated connection counts")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per target")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all targets, interleaved")
    parser.add_argument("--serve-args", default="", help='extra `batchapi serve` arguments, e.g. "--workers 2"')
    parser.add_argument("--peer-workers", type=int, default=None,
                        help="uvicorn processes of the peer (default: --workers N from --serve-args, else 1)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for the API, e.g. BATCHAPI_AUTH_CACHE_SECONDS=0 (repeatable)")
    parser.add_argument("--lines", type=int, default=64, help="requests in the polled batch")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write py-spy collapsed stacks of the API during the first poll measurement here")
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL, help="a fresh database is made and dropped here")
    args = parser.parse_args()
    serve_args = shlex.split(args.serve_args)
    peer_workers = args.peer_workers or (
        int(serve_args[serve_args.index("--workers") + 1]) if "--workers" in serve_args else 1)

    import psycopg

    workdir = Path(tempfile.mkdtemp(prefix="batchapi-poll-"))
    db_name = args.db_name = f"batchapi_poll_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(args.pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    database_url = args.pg_admin_url.rsplit("/", 1)[0] + "/" + db_name
    redis_port, api_port, peer_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    env.update({
        "BATCHAPI_DATA_DIR": str(workdir / "data"), "BATCHAPI_PORT": str(api_port),
        "BATCHAPI_DATABASE_URL": database_url, "BATCHAPI_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0",
    })
    env.update(item.split("=", 1) for item in args.env)
    procs = Processes(workdir, env)
    peer_base = f"http://127.0.0.1:{peer_port}"
    writer = None
    try:
        procs.spawn("redis", "redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
                    "--appendonly", "no", "--dir", str(workdir))
        subprocess.run([str(BIN), "db", "upgrade"], env=env, check=True, capture_output=True)
        made = subprocess.run([str(BIN), "keys", "create", "--project", "bench"], env=env, check=True,
                              capture_output=True, text=True)
        key = made.stdout.strip().splitlines()[-1]
        api = procs.spawn("api", str(BIN), "serve", *serve_args)
        base = f"http://127.0.0.1:{api_port}"
        wait_until(lambda: answers(base + "/health"), 120, f"the API (see {workdir}/api.log)")
        batch = start_batch(base, key, args.lines)
        writer = ProgressWriter(database_url, batch["id"])
        writer.start()
        poll_path, auth = f"/v1/batches/{batch['id']}", [f"Authorization: Bearer {key}"]
        body = httpx.get(base + poll_path, headers={"Authorization": f"Bearer {key}"}).content
        (workdir / "peer_body.json").write_bytes(body)
        peer_env = dict(env, POLL_LOAD_PEER_BODY=str(workdir / "peer_body.json"))

        results = []
        for round_ in range(args.repeat):
            for connections in [int(c) for c in args.connections.split(",")]:
                profile, args.profile = args.profile, None
                results.append(("poll", connections, measure(base, poll_path, auth, connections, args, api.pid,
                                                             profile)))
                results.append(("models", connections, measure(base, "/v1/models", auth, connections, args, api.pid)))
            if args.no_peer:
                continue
            procs.stop("api")  # the peer gets the cores to itself, as the API had them
            peer = procs.spawn(
                "peer", sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "--factory", "poll_load:peer_app",
                "--host", "127.0.0.1", "--port", str(peer_port), "--workers", str(peer_workers),
                "--no-access-log", "--log-level", "warning", env=peer_env,
            )
            wait_until(lambda: answers(peer_base + poll_path), 60, "the peer")
            for connections in [int(c) for c in args.connections.split(",")]:
                results.append(("peer", connections, measure(peer_base, poll_path, auth, connections, args, peer.pid)))
            procs.stop("peer")
            if round_ + 1 < args.repeat:
                api = procs.spawn("api", str(BIN), "serve", *serve_args)
                wait_until(lambda: answers(base + "/health"), 120, "the API")

        print(f"{' '.join(args.env)} batchapi serve {' '.join(serve_args)} on PostgreSQL, broker set (no worker), batch "
              f"{batch['id']} in_progress with {writer.writes} progress commits; peer: {peer_workers} uvicorn "
              f"process(es); {args.seconds:.0f} s per target after {args.warmup:.0f} s warm-up; "
              f"{os.cpu_count()} CPUs")
        print("| target | conns | rate /s | p50 ms | p99 ms | max ms | non-200 | API CPU s | API CPU ms/request | "
              "driver CPU s | PostgreSQL CPU s | machine CPU s | PG sessions opened | PG xacts/request |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, connections, r in results:
            print(row(name, connections, r))
        for connections in sorted({c for _, c, _ in results}):
            polls = [r["rate"] for name, c, r in results if name == "poll" and c == connections]
            peers = [r["rate"] for name, c, r in results if name == "peer" and c == connections]
            if peers:
                ratios = " / ".join(f"{p / q:.2f}" for p, q in zip(polls, peers, strict=False))
                print(f"poll/peer rate at {connections} connections: {ratios}")
        return 0
    finally:
        if writer is not None:
            writer.stopping.set()
            writer.join()
        procs.stop_all()
        with psycopg.connect(args.pg_admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        shutil.rmtree(workdir, ignore_errors=True)




if __name__ == "__main__":
    sys.exit(main())

"""`batchapi serve`'s worker is a child process: killed, it is started again, and the restarted
worker takes back the shards the dead one held at once, instead of waiting out their leases;
`batchapi serve` killed and started again does the same. Nothing is lost or done twice."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from batchapi.context import open_context
from batchapi.db.models import Shard
from tests.utils import services
from tests.utils.batch_service import service_settings
from tests.utils.waiting import wait_until
from tests.workers.helpers import assert_each_once, lines_for, results, submit

BATCHAPI = str(Path(sys.executable).parent / "batchapi")
LEASE_SECONDS = 600  # a shard that waited out its lease would fail the test's timeouts


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Serve:
    def __init__(self, tmp_path: Path, model_dir: Path):
        self.port = services.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
        self.env.update(
            BATCHAPI_DATA_DIR=str(tmp_path), BATCHAPI_MODEL=str(model_dir), BATCHAPI_PORT=str(self.port),
            BATCHAPI_AUTH_REQUIRED="false", BATCHAPI_DEVICE="cpu", BATCHAPI_SHARD_SIZE="4",
            BATCHAPI_MAX_NUM_SEQS="2", BATCHAPI_KV_CACHE_GB="0.05", BATCHAPI_SWEEP_SECONDS="0.5",
            BATCHAPI_WORKER_POLL_SECONDS="0.5", BATCHAPI_LEASE_SECONDS=str(LEASE_SECONDS),
            BATCHAPI_HEARTBEAT_SECONDS="1", BATCHAPI_RESULT_CACHE="false", BATCHAPI_ACCESS_LOG="false",
            BATCHAPI_RESULT_FLUSH_SECONDS="0.2",
        )
        self.log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115 - closed in stop
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([BATCHAPI, "serve"], env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_until(lambda: services.port_open("127.0.0.1", self.port), 120, 0.2, "batchapi serve")

    def worker(self, not_this: int | None = None) -> int:
        def one() -> int | None:
            found = [pid for pid in children(self.proc.pid) if pid != not_this and alive(pid)]
            return found[0] if len(found) == 1 else None

        return wait_until(one, 60, 0.1, "the worker process")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(90)
        self.log.close()


@pytest.fixture
def serve(tmp_path, tiny_llama_dir):
    server = Serve(tmp_path, tiny_llama_dir)
    server.start()
    yield server
    server.stop()
    # the service's own log, shown with a failing test's report (pytest keeps a passing test's output to itself)
    print((tmp_path / "serve.log").read_text(errors="replace")[-20_000:])


def in_flight(http: httpx.Client, batch_id: str) -> bool:
    """Some requests finished (durable), more to run."""
    batch = http.get(f"/v1/batches/{batch_id}").json()
    counts = batch["request_counts"]
    return batch["status"] == "in_progress" and 2 <= counts["completed"] < counts["total"] - 8


def finished(http: httpx.Client, batch_id: str, timeout: float) -> dict:
    return wait_until(lambda: (b := http.get(f"/v1/batches/{batch_id}").json())["status"] == "completed" and b,
                      timeout, 0.2, f"batch {batch_id} to complete")


def attempts(tmp_path: Path, model_dir: Path, batch_id: str) -> list[int]:
    ctx = open_context(service_settings(tmp_path, model_dir))
    try:
        with ctx.sessions() as session:
            return list(session.scalars(select(Shard.attempts).where(Shard.batch_id == batch_id)))
    finally:
        ctx.close()


def test_a_killed_worker_process_is_restarted_and_takes_its_shards_back(serve, tmp_path, tiny_llama_dir):
    with httpx.Client(base_url=serve.base_url, timeout=30) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        lines = lines_for(model, 32, prefix="kill-worker", max_tokens=24)
        batch_id = submit(http, lines)
        first = serve.worker()
        wait_until(lambda: in_flight(http, batch_id), 120, 0.05, "the batch under way")
        os.kill(first, signal.SIGKILL)

        serve.worker(not_this=first)
        assert serve.proc.poll() is None  # serve lives on, with a new worker
        batch = finished(http, batch_id, LEASE_SECONDS / 4)
        output, errors = results(http, batch)
        scraped = http.get("/metrics").text  # the new child's engine, through serve's own /metrics
    assert_each_once(lines, output, errors)
    assert errors == [] and batch["request_counts"]["completed"] == 32
    assert max(attempts(tmp_path, tiny_llama_dir, batch_id)) == 2  # what the killed one held ran again
    assert f'batchapi_engine_step_seconds_count{{model="{model}"}}' in scraped
    assert 'batchapi_batches{status="completed"}' in scraped  # and serve's own


def test_serve_killed_and_started_again_resumes_at_once(serve, tmp_path, tiny_llama_dir):
    with httpx.Client(base_url=serve.base_url, timeout=30) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        lines = lines_for(model, 32, prefix="kill-serve", max_tokens=24)
        batch_id = submit(http, lines)
        worker = serve.worker()
        wait_until(lambda: in_flight(http, batch_id), 120, 0.05, "the batch under way")
        engine_cores = children(worker)
        # everything at once, as the OOM killer or `docker kill` would: nobody gives anything back
        for pid in (serve.proc.pid, worker, *engine_cores):
            os.kill(pid, signal.SIGKILL)
        serve.proc.wait()
        wait_until(lambda: not any(alive(pid) for pid in (worker, *engine_cores)), 30, 0.1, "the old processes")

        serve.start()
        batch = finished(http, batch_id, LEASE_SECONDS / 4)
        output, errors = results(http, batch)
    assert_each_once(lines, output, errors)
    assert errors == [] and batch["request_counts"]["completed"] == 32
    assert max(attempts(tmp_path, tiny_llama_dir, batch_id)) == 2


def test_serve_killed_alone_takes_its_worker_down_with_it(serve):
    worker = serve.worker()
    engine_cores = wait_until(lambda: children(worker), 120, 0.1, "the worker's engine core process")
    os.kill(serve.proc.pid, signal.SIGKILL)
    serve.proc.wait()
    wait_until(lambda: not any(alive(pid) for pid in (worker, *engine_cores)), 60, 0.1,
               "the worker and its engine core to stop once serve is gone")


class PollLoad:
    """``rate`` polls/s in total of ``GET path`` over ``connections`` keep-alive sockets, each on a
    thread of its own and on a fixed schedule: raw HTTP/1.1, so the client's own CPU stays small.
    ``stop`` gives the polls answered with a 200 a second while it ran; a connection the server
    closed, an answer that is not a 200, or one 30 s late ends that thread's polls."""

    def __init__(self, port: int, path: str, rate: float, connections: int = 8):
        self.port, self.period = port, connections / rate
        self.request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        self.stopping = threading.Event()
        self.answered = [0] * connections  # each thread its own count
        self.started = time.monotonic()
        self.threads = [threading.Thread(target=self._run, args=(i, i / rate), daemon=True)
                        for i in range(connections)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int, offset: float) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            slot = time.monotonic() + offset
            while not self.stopping.is_set():
                time.sleep(max(0.0, slot - time.monotonic()))
                slot += self.period
                sock.sendall(self.request)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                header, body = head.split(b"\r\n\r\n", 1)
                if not header.startswith(b"HTTP/1.1 200"):
                    return
                length = int(next(line.split(b":")[1] for line in header.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return
                    body += chunk
                self.answered[index] += 1

    def stop(self) -> float:
        self.stopping.set()
        for thread in self.threads:
            thread.join(35)
        return sum(self.answered) / (time.monotonic() - self.started)


def test_polls_at_200_a_second_leave_the_batch_within_half_again_its_time(serve):
    """The embedded default's batch under 200 polls/s takes at most 1.5x its unloaded time (the
    best of two runs each way, interleaved; bench/poll_load.py measures the tighter 1.2x)."""
    with httpx.Client(base_url=serve.base_url, timeout=30) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        finished(http, submit(http, lines_for(model, 2, prefix="warm", max_tokens=2)), 120)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(2):
            for polled in (False, True):
                lines = lines_for(model, 24, prefix=f"polls-{round_}-{polled}", max_tokens=24)
                start = time.monotonic()
                batch_id = submit(http, lines)
                load = PollLoad(serve.port, f"/v1/batches/{batch_id}", 200) if polled else None
                batch = wait_until(lambda path=f"/v1/batches/{batch_id}": (b := http.get(path).json())["status"]
                                   == "completed" and b, 300, 0.05, "the batch")
                seconds[polled].append(time.monotonic() - start)
                if load is not None:
                    assert load.stop() >= 0.8 * 200  # polls/s answered: the API kept up with them
                assert batch["request_counts"]["completed"] == 24
    assert min(seconds[True]) <= 1.5 * min(seconds[False]), seconds

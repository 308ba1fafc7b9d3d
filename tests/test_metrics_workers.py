"""``batchapi serve --workers 2``: the API processes share their HTTP metrics (prometheus_client's
multiprocess files in a directory the server makes), so a scrape reaches any process and counts
the requests every process answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.utils import services
from tests.utils.scrape import scrape
from tests.utils.waiting import wait_until

BATCHAPI = str(Path(sys.executable).parent / "batchapi")
ROUTE = (("method", "GET"), ("route", "/v1/models"), ("status", "200"))


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def shared_dir(pid: int) -> Path:
    for child in children(pid):
        for entry in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError("no API process has PROMETHEUS_MULTIPROC_DIR")


@pytest.fixture
def two_processes(tmp_path, tiny_llama_dir, redis_url):
    port = services.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    with services.fresh_database("batchapi_metrics_workers") as pg_url:
        env.update(BATCHAPI_DATA_DIR=str(tmp_path), BATCHAPI_MODEL=str(tiny_llama_dir), BATCHAPI_BROKER_URL=redis_url,
                   BATCHAPI_DATABASE_URL=pg_url, BATCHAPI_PORT=str(port), BATCHAPI_AUTH_REQUIRED="false",
                   BATCHAPI_ACCESS_LOG="false")
        subprocess.run([BATCHAPI, "db", "upgrade"], env=env, check=True, capture_output=True, timeout=120)
        with open(tmp_path / "serve.log", "wb") as log:
            proc = subprocess.Popen([BATCHAPI, "serve", "--workers", "2"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(lambda: services.port_open("127.0.0.1", port), 90, 0.2, "batchapi serve --workers 2")
            wait_until(lambda: len(children(proc.pid)) >= 2, 30, 0.2, "two API processes")
            yield f"http://127.0.0.1:{port}", proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)


def test_any_process_reports_the_requests_of_all(two_processes):
    base_url, proc = two_processes
    directory = shared_dir(proc.pid)
    answered = 0
    # new connections until both processes have answered (each writes its own file)
    while answered < 40 or len(list(directory.glob("histogram_*.db"))) < 2:
        assert answered < 2000, f"one process answered everything: {list(directory.iterdir())}"
        assert httpx.get(f"{base_url}/v1/models").status_code == 200
        answered += 1
    counts = {scrape(base_url)[("batchapi_http_request_duration_seconds_count", ROUTE)] for _ in range(6)}
    assert counts == {answered}
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    assert not directory.exists()  # the server removes its directory when it stops

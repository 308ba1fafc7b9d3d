"""A production-shaped deployment for the worker tests, on real services.

One per test module: a private redis-server on a free port (so a test may restart it), a
fresh PostgreSQL database, SeaweedFS under a unique prefix, the API (uvicorn in a thread,
with the Celery dispatcher), the sweeper (``run_beat`` in a thread) and ``batchapi worker``
subprocesses, which the tests may kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from batchapi.config import Settings
from batchapi.jobs.migrate import upgrade
from tests.utils import services
from tests.utils.batch_service import live_server, service_settings

BATCHAPI = str(Path(sys.executable).parent / "batchapi")

# small and fast: short leases so a killed worker's shards come back within seconds
WORKER_SETTINGS = dict(
    shard_size=10, lease_seconds=6, heartbeat_seconds=1.0, sweep_seconds=1.0, worker_poll_seconds=0.5,
    max_shards_in_flight=2, engine_watermark=4, max_num_seqs=8, max_num_batched_tokens=256,
    kv_cache_gb=0.05, device="cpu", auth_required=False,
)


class RedisServer:
    """A redis-server of our own, keeping nothing on disk; ``restart`` drops every message."""

    def __init__(self, workdir: Path):
        self.port = services.free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        services.wait_for(lambda: services.port_open("127.0.0.1", self.port), 30, "private redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, down_seconds: float = 2.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


class Cluster:
    def __init__(self, settings: Settings, env: dict[str, str], logdir: Path, redis: RedisServer):
        self.settings = settings
        self.env = env
        self.logdir = logdir
        self.redis = redis
        self.workers: dict[str, subprocess.Popen] = {}
        self.base_url = ""
        self.server = None

    @property
    def jobs(self):
        return self.server.jobs

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30)

    def start_worker(self, name: str | None = None) -> str:
        name = name or f"w{len(self.workers)}-{uuid.uuid4().hex[:4]}"
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        self.workers[name] = subprocess.Popen(
            [BATCHAPI, "worker", "-n", f"{name}@%h"], env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return name

    def wait_ready(self, name: str, timeout: float = 120) -> None:
        path = self.logdir / f"{name}.log"
        services.wait_for(
            lambda: self.workers[name].poll() is None and b" ready." in path.read_bytes(), timeout,
            f"worker {name} to be ready",
        )

    def kill_worker(self, name: str) -> None:
        """``kill -9`` the worker process: no cleanup, no acks, its leases just stop."""
        proc = self.workers.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_workers(self) -> None:
        for name in list(self.workers):
            proc = self.workers.pop(name)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)

    def worker_log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")


def _env_of(settings: Settings, redis: RedisServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    for field in (
        "data_dir", "database_url", "storage_url", "s3_endpoint_url", "s3_region", "s3_access_key_id",
        "s3_secret_access_key", "model", "model_cache", "celery_queue", *WORKER_SETTINGS,
    ):
        env[f"BATCHAPI_{field.upper()}"] = str(getattr(settings, field))
    env["BATCHAPI_BROKER_URL"] = redis.url
    return env


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3, tiny_llama_dir):
    from batchapi.workers.celery_app import CeleryDispatcher, make_celery
    from batchapi.workers.processes import run_beat

    workdir = tmp_path_factory.mktemp("cluster")
    redis = RedisServer(workdir)
    redis.start()
    with ExitStack() as stack:
        stack.callback(redis.stop)
        pg_url = stack.enter_context(services.fresh_database("batchapi_workers"))
        settings = service_settings(
            workdir, tiny_llama_dir, pg_url=pg_url, s3=s3, broker_url=redis.url,
            celery_queue=f"gpu-test-{uuid.uuid4().hex[:8]}", **WORKER_SETTINGS,
        )
        upgrade(settings)
        cluster = Cluster(settings, _env_of(settings, redis), workdir, redis)
        stack.callback(cluster.stop_workers)
        dispatcher = CeleryDispatcher(make_celery(settings), settings.celery_queue)
        server = stack.enter_context(live_server(settings, dispatcher=dispatcher))
        cluster.server, cluster.base_url = server, server.base_url
        stop_beat = threading.Event()
        beat = threading.Thread(target=run_beat, args=(settings, stop_beat), daemon=True)
        beat.start()
        stack.callback(beat.join, 20)
        stack.callback(stop_beat.set)
        yield cluster

"""A production-shaped deployment for the worker tests, on real services.

One per test module: a private redis-server on a free port (so a test may restart it), a
fresh PostgreSQL database, SeaweedFS under a unique prefix, the API (uvicorn in a thread,
with the Celery dispatcher), ``batchapi beat`` (Celery beat running the sweeper) and
``batchapi worker`` subprocesses, which the tests may kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from batchapi.config import Settings
from batchapi.db.migrate import upgrade
from tests.utils import services
from tests.utils.batch_service import live_server, service_settings
from tests.workers import processes
from tests.workers.processes import RedisServer

# small and fast: short leases so a killed worker's shards come back within seconds
WORKER_SETTINGS = dict(
    shard_size=10, lease_seconds=6, heartbeat_seconds=1.0, sweep_seconds=1.0, worker_poll_seconds=0.5,
    max_shards_in_flight=2, engine_watermark=4, max_num_seqs=8, max_num_batched_tokens=256,
    kv_cache_gb=0.05, device="cpu", auth_required=False,
)


class Cluster:
    def __init__(self, settings: Settings, logdir: Path, redis: RedisServer):
        self.settings = settings
        self.env = processes.env_of(settings)
        self.logdir = logdir
        self.redis = redis
        self.workers: dict[str, subprocess.Popen] = {}
        self.beat: subprocess.Popen | None = None
        self.base_url = ""
        self.server = None

    @property
    def ctx(self):
        return self.server.ctx

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30)

    def start_beat(self) -> None:
        self.beat = processes.spawn(["beat"], self.env, self.logdir / "beat.log")
        processes.wait_ready(self.beat, self.logdir / "beat.log", "batchapi beat")

    def stop_beat(self) -> None:
        if self.beat is not None:
            processes.stop(self.beat)

    def start_worker(self, name: str | None = None, prelude: str | None = None, env: dict | None = None) -> str:
        """``env``: variables of this worker's own on top of the cluster's."""
        name = name or f"w{len(self.workers)}-{uuid.uuid4().hex[:4]}"
        self.workers[name] = processes.spawn(["worker", "-n", f"{name}@%h"], {**self.env, **(env or {})},
                                             self.logdir / f"{name}.log", prelude)
        return name

    def wait_ready(self, name: str, timeout: float = 120) -> None:
        processes.wait_ready(self.workers[name], self.logdir / f"{name}.log", f"worker {name}", timeout)

    def kill_worker(self, name: str) -> None:
        """``kill -9`` the worker process: no cleanup, no acks, its leases just stop."""
        proc = self.workers.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop_workers(self) -> None:
        for name in list(self.workers):
            processes.stop(self.workers.pop(name))

    def worker_log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")


@contextmanager
def running_cluster(workdir: Path, s3, model_dir: Path, database: str, settings: dict) -> Iterator[Cluster]:
    """A private redis-server, a fresh database, the API with a Celery dispatcher, and the beat;
    workers are the test's to start (``cluster.start_worker``)."""
    from batchapi.workers.celery_app import CeleryDispatcher, make_celery

    redis = RedisServer(workdir)
    redis.start()
    with ExitStack() as stack:
        stack.callback(redis.stop)
        pg_url = stack.enter_context(services.fresh_database(database))
        settings = service_settings(
            workdir, model_dir, pg_url=pg_url, s3=s3, broker_url=redis.url,
            celery_queue=f"gpu-test-{uuid.uuid4().hex[:8]}", **settings,
        )
        upgrade(settings)
        cluster = Cluster(settings, workdir, redis)
        stack.callback(cluster.stop_workers)
        dispatcher = CeleryDispatcher(make_celery(settings), settings.celery_queue, settings)  # a queue per model
        server = stack.enter_context(live_server(settings, dispatcher=dispatcher))
        cluster.server, cluster.base_url = server, server.base_url
        stack.callback(cluster.stop_beat)
        cluster.start_beat()
        yield cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3, tiny_llama_dir):
    with running_cluster(tmp_path_factory.mktemp("cluster"), s3, tiny_llama_dir, "batchapi_workers",
                         WORKER_SETTINGS) as cluster:
        yield cluster

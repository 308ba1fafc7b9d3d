"""Factories for the service tests: settings per backend, request lines, a live uvicorn server,
API keys for it."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from batchapi.config import Settings, load_settings
from batchapi.db.projects import create_api_key
from batchapi.db.session import session_scope
from tests.utils.services import S3Server, free_port
from tests.utils.waiting import wait_for_batch, wait_until

CHAT = "/v1/chat/completions"


def service_settings(
    tmp_path: Path, model_dir: Path, pg_url: str | None = None, s3: S3Server | None = None, **overrides
) -> Settings:
    """PostgreSQL and S3 when given, else SQLite and a local directory, with the tiny model."""
    # webhook tests post to receivers on 127.0.0.1; tests/webhooks/test_addresses.py turns it off
    # the result cache off: tests that run a file twice (invariance, metrics, usage) mean to run it;
    # tests/e2e/test_result_cache.py turns it on
    values = dict(data_dir=tmp_path, model=str(model_dir), shard_size=4, sweep_seconds=0.5,
                  webhook_allow_private=True, result_cache=False)
    if pg_url:
        values["database_url"] = pg_url
    if s3 is not None:
        values.update(
            storage_url=f"s3://{s3.bucket}/{uuid.uuid4().hex[:8]}",
            s3_endpoint_url=s3.endpoint_url,
            s3_region=s3.region,
            s3_access_key_id=s3.aws_access_key_id,
            s3_secret_access_key=s3.aws_secret_access_key,
        )
    values.update(overrides)
    return load_settings(**values)


def request_line(custom_id: str, model: str, content: str = "Say hello.", url: str = CHAT, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": model, "messages": [{"role": "user", "content": content}], **body},
    }


def jsonl(lines: list) -> bytes:
    """Dicts become JSON lines; str and bytes are taken as the raw line."""
    out = []
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        out.append(line if isinstance(line, bytes) else line.encode())
    return b"\n".join(out) + b"\n"


@dataclass
class LiveServer:
    base_url: str
    app: object
    worker: object = None  # the embedded worker, when the server runs one

    @property
    def ctx(self):
        return self.app.state.ctx


@contextmanager
def live_server(settings: Settings, **app_kwargs) -> Iterator[LiveServer]:
    """The app under uvicorn on a free port in a thread, stopped afterwards."""
    import uvicorn

    from batchapi.api.limits import server_options
    from batchapi.api.main import create_app

    app = create_app(settings, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **server_options()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        assert thread.is_alive(), "uvicorn exited before it started"
        return server.started

    wait_until(started, timeout=30, interval=0.02, message="uvicorn to start")
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def pg_live_server(data_dir: Path, model_dir: Path, s3: S3Server, name: str | None = None,
                   **overrides) -> Iterator[LiveServer]:
    """A live server (no worker) on S3 and a PostgreSQL database of its own, created, migrated and
    dropped afterwards: its sweeper (every 0.5 s, over every project) takes up nothing that another
    server or the tests on ``pg_jobs`` left in theirs."""
    from batchapi.db.migrate import upgrade
    from tests.utils import services

    with services.fresh_database(*([f"batchapi_{name}"] if name else [])) as pg_url:
        settings = service_settings(data_dir, model_dir, pg_url=pg_url, s3=s3, **overrides)
        upgrade(settings)
        with live_server(settings) as server:
            yield server


def new_key(server: LiveServer, project: str) -> str:
    """A fresh API key of ``project`` (made if new) on ``server``'s database."""
    with session_scope(server.ctx.sessions) as session:
        return create_api_key(session, project)


# the live stack of the end-to-end API tests: quick sweeps and leases, the embedded worker on CPU
EMBEDDED = dict(sweep_seconds=0.5, worker_poll_seconds=0.5, kv_cache_gb=0.25, device="cpu", lease_seconds=30,
                heartbeat_seconds=2.0)


@contextmanager
def embedded_stack(tmp_path: Path, model_dir: Path, name: str | None, s3: S3Server | None = None,
                   **overrides) -> Iterator[LiveServer]:
    """A live server with the embedded worker running shards in the same process (``server.worker``):
    on a fresh PostgreSQL database named after ``name`` (and S3 when given), or with ``name`` None
    on the embedded default, SQLite and a local storage directory."""
    from batchapi.db.migrate import upgrade
    from batchapi.workers.embedded import EmbeddedWorker
    from tests.utils import services

    with services.fresh_database(f"batchapi_{name}") if name else nullcontext() as pg_url:
        settings = service_settings(tmp_path, model_dir, pg_url=pg_url, s3=s3, **{**EMBEDDED, **overrides})
        upgrade(settings)
        worker = EmbeddedWorker()
        with live_server(settings, dispatcher=worker, hook=worker.run, sweep_shards=True) as server:
            server.worker = worker
            yield server


def run_to_end(client, lines: list, endpoint: str, timeout: float = 600):
    """Through the openai SDK: upload ``lines``, create a batch on ``endpoint``, wait until it
    completes; (batch, {custom_id: output line}, {custom_id: error line})."""
    import io

    uploaded = client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    batch = wait_for_batch(client, batch.id, timeout=timeout, interval=0.3)
    assert batch.status == "completed", batch.errors

    def read(file_id):
        if file_id is None:
            return {}
        records = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
        return {r["custom_id"]: r for r in records}

    return batch, read(batch.output_file_id), read(batch.error_file_id)

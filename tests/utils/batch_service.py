"""Factories for the service tests: settings per backend, request lines, a live uvicorn server."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from batchapi.config import Settings, load_settings
from tests.utils.services import S3Server, free_port

CHAT = "/v1/chat/completions"


def service_settings(
    tmp_path: Path, model_dir: Path, pg_url: str | None = None, s3: S3Server | None = None, **overrides
) -> Settings:
    """PostgreSQL and S3 when given, else SQLite and a local directory, with the tiny model."""
    values = dict(data_dir=tmp_path, model=str(model_dir), shard_size=4, sweep_seconds=0.5)
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

    @property
    def jobs(self):
        return self.app.state.jobs


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
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)

"""One log format for every process: JSON lines with BATCHAPI_LOG_FORMAT=json, carrying the
request id (and batch and shard ids where known); plain text by default."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from batchapi import logs
from tests.utils import services
from tests.utils.waiting import wait_until

BATCHAPI = str(Path(sys.executable).parent / "batchapi")


@pytest.fixture
def configured(capfd):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield lambda fmt: logs.configure(fmt)
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.captureWarnings(False)


def test_json_lines_carry_the_bound_and_the_found_ids(configured, capfd):
    configured("json")
    log = logging.getLogger("batchapi.test")
    with logs.bind(request_id="req_abc"):
        log.info("validated %s", "batch_0123456789abcdef0123")
    log.warning("shard %s lost its lease", "batch_0123456789abcdef0123_00007")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"batch_id": "batch_given"})
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()]
    assert [line["level"] for line in lines] == ["INFO", "WARNING", "ERROR"]
    assert lines[0]["request_id"] == "req_abc" and lines[0]["batch_id"] == "batch_0123456789abcdef0123"
    assert lines[0]["logger"] == "batchapi.test" and lines[0]["message"] == "validated batch_0123456789abcdef0123"
    assert lines[0]["timestamp"].endswith("+00:00")
    assert "request_id" not in lines[1]
    assert lines[1]["shard_id"] == "batch_0123456789abcdef0123_00007"
    assert lines[2]["batch_id"] == "batch_given" and "ValueError: boom" in lines[2]["exception"]


def test_warnings_are_log_lines_too(configured, capfd):
    import warnings

    configured("json")
    warnings.warn("careful", UserWarning, stacklevel=1)
    [line] = [json.loads(line) for line in capfd.readouterr().err.splitlines()]
    assert line["logger"] == "py.warnings" and "UserWarning: careful" in line["message"]


def test_text_is_the_default_with_the_ids_after_the_message(configured, capfd):
    configured("text")
    with logs.bind(request_id="req_1"):
        logging.getLogger("batchapi.test").info("hello")
    line = capfd.readouterr().err.strip()
    assert line.endswith("INFO batchapi.test: hello [request_id=req_1]")


def _env(tmp_path: Path, tiny_llama_dir: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    env.update(BATCHAPI_DATA_DIR=str(tmp_path), BATCHAPI_MODEL=str(tiny_llama_dir), BATCHAPI_LOG_FORMAT="json",
               **extra)
    return env


def test_the_cli_logs_json_lines(tmp_path, tiny_llama_dir):
    done = subprocess.run([BATCHAPI, "db", "upgrade"], env=_env(tmp_path, tiny_llama_dir), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert any(line["logger"].startswith("alembic") for line in lines)


def test_the_api_server_logs_json_lines_with_the_request_id(tmp_path, tiny_llama_dir, redis_url):
    port = services.free_port()
    env = _env(tmp_path, tiny_llama_dir, BATCHAPI_BROKER_URL=redis_url, BATCHAPI_PORT=str(port),
               BATCHAPI_AUTH_REQUIRED="false")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([BATCHAPI, "serve"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: services.port_open("127.0.0.1", port), 60, 0.2, "batchapi serve")
        response = httpx.get(f"http://127.0.0.1:{port}/v1/batches/batch_0123456789abcdef0123",
                             headers={"x-request-id": "logs-test-1"})
        assert response.status_code == 404 and response.headers["x-request-id"] == "logs-test-1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    assert access and access[0]["request_id"] == "logs-test-1"
    assert access[0]["batch_id"] == "batch_0123456789abcdef0123" and "404" in access[0]["message"]
    assert any(line["logger"] == "uvicorn.error" and "Started server process" in line["message"] for line in lines)

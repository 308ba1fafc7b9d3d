"""A real ``batchapi serve`` (API only: PostgreSQL, a Redis broker, local storage) in a child
process, whose memory can be read from /proc: what one request grows it by. Also the create
bodies that tests/api/test_tenant_attacks.py and bench/message_batch_memory.py send it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.utils import services
from tests.utils.waiting import wait_until

BIN = Path(sys.executable).parent / "batchapi"
ANTHROPIC = {"anthropic-version": "2023-06-01", "content-type": "application/json"}


def oversized_body(size: int) -> bytes:
    """``size`` bytes of one request whose params are many short messages (not one long string: a
    single token is read whole by any JSON reader)."""
    head, tail = b'{"requests":[{"custom_id":"big","params":{"model":"m","max_tokens":1,"messages":[', b"]}}]}"
    item = b'{"role":"user","content":"hello there"},'
    count = (size - len(head) - len(tail)) // len(item)
    return head + item * count + item[:-1] + tail


def valid_body(count: int, model: str, content_bytes: int = 64) -> bytes:
    """``count`` small valid requests."""
    text = "x" * max(content_bytes - 100, 1)
    return json.dumps({"requests": [
        {"custom_id": f"r{i}", "params": {"model": model, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": text}]}}
        for i in range(count)]}).encode()


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of ``pid``, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


class ApiProcess:
    """``with ApiProcess(data_dir, database_url, model_dir) as api``: the server, its key and pid.
    ``source``: a checkout whose ``batchapi`` package to run instead of the installed one."""

    def __init__(self, data_dir: Path, database_url: str, model_dir: Path, source: Path | None = None, **env):
        services.ensure_redis()
        self.port = services.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
        self.env.update(BATCHAPI_DATA_DIR=str(data_dir), BATCHAPI_DATABASE_URL=database_url,
                        BATCHAPI_BROKER_URL=f"redis://{services.REDIS_HOST}:{services.REDIS_PORT}/0",
                        BATCHAPI_MODEL=str(model_dir), BATCHAPI_PORT=str(self.port), **env)
        self.source = source
        self.process: subprocess.Popen | None = None
        self.key = ""

    def __enter__(self) -> ApiProcess:
        upgraded = subprocess.run([str(BIN), "db", "upgrade"], env=self.env, capture_output=True, text=True)
        assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
        made = subprocess.run([str(BIN), "keys", "create", "--project", "tenant"], env=self.env, check=True,
                              capture_output=True, text=True)
        self.key = made.stdout.strip().splitlines()[-1]
        env = self.env if self.source is None else {**self.env, "PYTHONPATH": str(self.source)}  # the schema: ours
        self.process = subprocess.Popen([str(BIN), "serve"], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: services.port_open("127.0.0.1", self.port), 120, 0.2, "batchapi serve")
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=60)

    def post_messages(self, body: bytes) -> httpx.Response:
        headers = {**ANTHROPIC, "x-api-key": self.key}
        return httpx.post(f"{self.base_url}/v1/messages/batches", content=body, headers=headers, timeout=600)

    def measure(self, body: bytes) -> tuple[httpx.Response, int]:
        """POST ``body``: the answer and how far the server's peak resident memory rose above its
        resident memory just before, in bytes."""
        pid = self.process.pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        before = memory_kib(pid)["VmRSS"]
        answer = self.post_messages(body)
        return answer, (memory_kib(pid)["VmHWM"] - before) * 1024

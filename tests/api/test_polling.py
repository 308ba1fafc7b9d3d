"""Polling `GET /v1/batches/{id}`: what makes it cheap (the key cache, `serve --workers`) keeps
its promises: a revoked key is refused within BATCHAPI_AUTH_CACHE_SECONDS, and the answer is the
batch as the schema says."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from batchapi.api.routes.batches import PollShortcut
from batchapi.api.schemas import BatchObject
from batchapi.db.models import Batch, Project
from batchapi.db.projects import KeyCache, list_keys, revoke_key
from batchapi.db.reads import AsyncReads, open_reads
from tests.utils.batch_service import new_key
from tests.utils.job_rows import make_batch
from tests.utils.services import free_port, fresh_database
from tests.utils.waiting import wait_until

BIN = Path(sys.executable).parent / "batchapi"


def test_a_revoked_key_is_refused_once_the_cache_seconds_pass(pg_server):
    bound = pg_server.ctx.settings.auth_cache_seconds
    assert bound > 0, "the live server runs with the key cache on"
    key = new_key(pg_server, "poll-revoked-project")
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
        assert http.get("/v1/batches").status_code == 200  # the key is cached from here
        [info] = list_keys(pg_server.ctx.settings, "poll-revoked-project")
        assert revoke_key(pg_server.ctx.settings, info.id)
        revoked = time.monotonic()
        time.sleep(max(0.0, revoked + bound - time.monotonic()))
        responses = [http.get("/v1/batches") for _ in range(3)]
    assert [r.status_code for r in responses] == [401, 401, 401]
    assert responses[0].json()["error"]["code"] == "invalid_api_key"


def test_unknown_keys_are_not_cached(pg_server):
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": "Bearer sk-batch-nope"}) as http:
        assert [http.get("/v1/batches/batch_x").status_code for _ in range(3)] == [401, 401, 401]


def test_a_poll_answers_the_batch_as_the_schema_says(pg_server):
    batch_id, _ = make_batch(pg_server.ctx, shards=3)
    with pg_server.ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
        project = session.get(Project, batch.project_id)
    key = new_key(pg_server, project.name)
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
        response = http.get(f"/v1/batches/{batch_id}")
        missing = http.get("/v1/batches/batch_missing")
        schema = http.get("/openapi.json").json()
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == BatchObject.of(batch).model_dump(mode="json")
    assert response.json()["status"] == "in_progress"
    assert response.json()["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "batch_id"
    ok = schema["paths"]["/v1/batches/{batch_id}"]["get"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/BatchObject"}


def _serve(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(BIN), "serve", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, NotADirectoryError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def test_serve_with_workers_runs_processes_that_answer(tmp_path, redis_url, tiny_llama_dir):
    with fresh_database() as database_url:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
        env.update(BATCHAPI_DATA_DIR=str(tmp_path), BATCHAPI_DATABASE_URL=database_url,
                   BATCHAPI_BROKER_URL=redis_url, BATCHAPI_MODEL=str(tiny_llama_dir), BATCHAPI_PORT=str(port))
        subprocess.run([str(BIN), "db", "upgrade"], env=env, check=True, capture_output=True)
        made = subprocess.run([str(BIN), "keys", "create", "--project", "workers"], env=env, check=True,
                              capture_output=True, text=True)
        key = made.stdout.strip().splitlines()[-1]
        server = _serve(env, "--workers", "2")
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until(lambda: _answers(base + "/health"), 120, 0.2, "batchapi serve --workers 2")
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as http:
                assert {http.get("/v1/batches").status_code for _ in range(20)} == {200}
            workers = [pid for pid in _children(server.pid)
                       if b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes()
                       and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
            assert len(workers) == 2, workers
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            output = server.communicate(timeout=60)[0].decode(errors="replace")
        assert server.returncode == 0, output
        assert output.count("Application startup complete.") == 2, output


def test_serve_with_workers_needs_a_broker(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHAPI_")}
    env.update(BATCHAPI_DATA_DIR=str(tmp_path))
    server = _serve(env, "--workers", "2")
    output = server.communicate(timeout=120)[0].decode()
    assert server.returncode == 2
    assert "BATCHAPI_API_WORKERS above 1 needs BATCHAPI_BROKER_URL" in " ".join(output.split())


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_the_poll_shortcut_answers_a_cached_key_and_leaves_everything_else_to_the_app(sqlite_jobs):
    batch_id, _ = make_batch(sqlite_jobs, shards=2)
    with sqlite_jobs.sessions() as session:
        stored = session.get(Batch, batch_id)
        expected = BatchObject.of(stored).model_dump_json().encode()
    key_cache = KeyCache(60)
    key_cache.put("sk-cached", stored.project_id)
    key_cache.put("sk-other-project", "proj_other")
    state = SimpleNamespace(ctx=sqlite_jobs, key_cache=key_cache, reads=open_reads(sqlite_jobs.settings))
    to_app: list[str] = []

    async def app(scope, receive, send):
        to_app.append(f"{scope['method']} {scope['path']}")

    shortcut = PollShortcut(app, state)

    async def get(path: str, key: str, method: str = "GET") -> list[dict]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "headers": [(b"authorization", f"Bearer {key}".encode())]}
        await shortcut(scope, None, send)
        return sent

    async def polls():
        await state.reads.open()
        try:
            return [await get(f"/v1/batches/{batch_id}", "sk-cached"),
                    await get(f"/v1/batches/{batch_id}", "sk-unknown"),  # not in the cache: the app asks
                    await get(f"/v1/batches/{batch_id}", "sk-other-project"),  # not theirs: the app's 404
                    await get("/v1/batches/batch_0123abc", "sk-cached"),  # no such batch
                    await get(f"/v1/batches/{batch_id}/cancel", "sk-cached", "POST")]
        finally:
            await state.reads.close()

    async def unreachable():  # the app's 503, at once (the app would wait for the same pool again)
        state.reads = AsyncReads("postgresql://postgres@127.0.0.1:1/nothing?connect_timeout=1", 1, timeout=1.0)
        await state.reads.pool.open(wait=False)
        try:
            return await get(f"/v1/batches/{batch_id}", "sk-cached")
        finally:
            await state.reads.close()

    answered, *passed_on = asyncio.run(polls())
    down = asyncio.run(unreachable())
    assert answered == [
        {"type": "http.response.start", "status": 200,
         "headers": [(b"content-length", str(len(expected)).encode()), (b"content-type", b"application/json")]},
        {"type": "http.response.body", "body": expected},
    ]
    assert passed_on == [[], [], [], []]
    assert to_app == [f"GET /v1/batches/{batch_id}"] * 2 + ["GET /v1/batches/batch_0123abc",
                                                             f"POST /v1/batches/{batch_id}/cancel"]
    assert down[0]["status"] == 503 and (b"retry-after", b"1") in down[0]["headers"]
    assert json.loads(down[1]["body"])["error"]["code"] == "database_unavailable"

"""Runs of batches to compare (``/v1/batches/{id}/diff``): batches run to their end on a live
server, a result changed in storage as a nondeterministic engine would have written it, a batch
row held in progress."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal

import httpx

from batchapi.db.clock import now
from batchapi.db.models import ApiKey, Batch, File, Shard
from batchapi.db.projects import hash_key
from batchapi.db.session import session_scope
from tests.utils.batch_service import CHAT, LiveServer, jsonl
from tests.utils.waiting import wait_until

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def upload(http: httpx.Client, lines: list) -> str:
    answer = http.post("/v1/files", files={"file": ("runs.jsonl", jsonl(lines))}, data={"purpose": "batch"})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def run_file(http: httpx.Client, file_id: str, endpoint: str = CHAT) -> dict:
    """A batch over the uploaded ``file_id``, waited for until it ends."""
    answer = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                            "completion_window": "24h"})
    assert answer.status_code == 200, answer.text
    batch_id = answer.json()["id"]
    return wait_until(lambda: (b := http.get(f"/v1/batches/{batch_id}").json())["status"] in TERMINAL and b,
                      timeout=300, interval=0.1)


def change_result(server: LiveServer, file_id: str, custom_id: str, content: str) -> None:
    """Rewrite the chat answer of ``custom_id`` in the output file ``file_id``, in storage."""
    with server.ctx.sessions() as session:
        key = session.get(File, file_id).storage_key
    lines = b"".join(server.ctx.storage.iter_chunks(key)).splitlines()
    out, changed = [], 0
    for line in lines:
        record = json.loads(line)
        if record["custom_id"] == custom_id:
            record["response"]["body"]["choices"][0]["message"]["content"] = content
            changed += 1
        out.append(json.dumps(record).encode() + b"\n")
    assert changed == 1, f"{custom_id} is not in {file_id}"
    server.ctx.storage.put_chunks(key, out)


def held_batch(server: LiveServer, key: str, file_id: str, model: str) -> str:
    """A batch of ``key``'s project held in progress: its one shard leased far ahead by nobody."""
    t = now()
    with session_scope(server.ctx.sessions) as session:
        project_id = session.query(ApiKey).filter_by(key_hash=hash_key(key)).one().project_id
        batch = Batch(id=f"batch_{uuid.uuid4().hex}", project_id=project_id, endpoint=CHAT, model=model,
                      input_file_id=file_id, completion_window="24h", status="in_progress", created_at=t,
                      in_progress_at=t, expires_at=t + 3600, request_total=1, price_input=Decimal(1),
                      price_cached_input=Decimal(1), price_output=Decimal(1), discount_percent=Decimal(50))
        session.add(batch)
        session.flush()
        session.add(Shard(id=f"{batch.id}_00000", batch_id=batch.id, index=0, first_line=1, last_line=1,
                          start_byte=0, end_byte=0, request_count=1, status="running", lease_owner="nobody",
                          lease_expires_at=t + 3600, attempts=1, created_at=t, tokens_counted=True,
                          prompt_token_counts=[1]))
    return batch.id

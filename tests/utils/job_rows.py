"""Job rows written straight into the database, for tests of what runs after the API:
a project, its input file row and a batch of one-request shards (no input object in storage)."""

from __future__ import annotations

import uuid
from decimal import Decimal

from batchapi.batches.states import ShardStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch, File, Project, Shard
from batchapi.db.session import session_scope


def make_project(ctx: Context, weight: int = 1) -> str:
    tag = uuid.uuid4().hex[:12]
    with session_scope(ctx.sessions) as session:
        session.add(Project(id=f"proj_{tag}", name=f"p-{tag}", created_at=now(), weight=weight))
    return f"proj_{tag}"


def make_batch(ctx: Context, shards: int, status: str = "in_progress", expires_in: int = 3600,
               project_id: str | None = None, work: int = 0, priority: int = 0,
               created_at: int | None = None) -> tuple[str, list[str]]:
    """A batch of one-request shards of ``work`` estimated tokens each, in a new project or ``project_id``'s."""
    t, tag = now(), uuid.uuid4().hex[:12]
    project_id = project_id or make_project(ctx)
    with session_scope(ctx.sessions) as session:
        # no ORM relationships: rows go in foreign-key order by hand
        file = File(id=f"file-{tag}", project_id=project_id, filename="in.jsonl", purpose="batch", bytes=0,
                    storage_key="files/none", created_at=t)
        batch = Batch(
            id=f"batch_{tag}", project_id=project_id, endpoint="/v1/chat/completions", input_file_id=file.id,
            completion_window="24h", status=status, created_at=t if created_at is None else created_at,
            expires_at=t + expires_in, request_total=shards, priority=priority,
            estimated_input_tokens=work * shards, in_progress_at=t if status == "in_progress" else None,
            price_input=Decimal(1), price_cached_input=Decimal(1), price_output=Decimal(1),
            discount_percent=Decimal(50),
        )
        session.add_all([file, batch])
        session.flush()
        ids = [f"{batch.id}_{i:05d}" for i in range(shards)]
        session.add_all(
            Shard(id=sid, batch_id=batch.id, index=i, first_line=i + 1, last_line=i + 1, start_byte=0, end_byte=0,
                  request_count=1, prompt_token_counts=[1], prompt_tokens=work, status=ShardStatus.QUEUED,
                  created_at=t)
            for i, sid in enumerate(ids)
        )
    return batch.id, ids


def shard(ctx: Context, shard_id: str) -> Shard:
    with ctx.sessions() as session:
        return session.get(Shard, shard_id)

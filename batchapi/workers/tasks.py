"""Celery task bodies: as thin as views. They take ids and hand them to this process's runner.

The runner (and so the engine) is built once per worker process by ``batchapi worker``
before it consumes anything, and installed here with ``install``.
"""

from __future__ import annotations

from celery import Celery

from batchapi.errors import TASK_RETRY
from batchapi.workers.celery_app import RUN_SHARD
from batchapi.workers.shard_runner import ShardRunner

_runner: ShardRunner | None = None


def install(runner: ShardRunner | None) -> None:
    global _runner
    _runner = runner


def run_shard(shard_id: str) -> str:
    """Claim and run one shard; a duplicate or late message finds it taken and returns."""
    assert _runner is not None, "the worker's runner is not installed (start it with `batchapi worker`)"
    return _runner.run_shard(shard_id)


def register(app: Celery) -> None:
    app.task(name=RUN_SHARD, autoretry_for=TASK_RETRY, retry_backoff=True, max_retries=5)(run_shard)

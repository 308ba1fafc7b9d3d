"""Shards go to the workers of their model: one Celery queue per model on a real Redis, and a
worker's claims (by task or by polling) take only the shards of the models it serves."""

from __future__ import annotations

import base64
import json
import uuid

import redis
from sqlalchemy import update

from batchapi.batches import leases
from batchapi.config import load_settings
from batchapi.db.models import Batch, Shard
from batchapi.db.session import session_scope
from batchapi.workers.celery_app import RUN_SHARD, CeleryDispatcher, make_celery, shard_queue, worker_queues
from tests.utils.job_rows import make_batch


def queued(url: str, queue: str) -> list[tuple[str, list]]:
    client = redis.Redis.from_url(url)
    try:
        raw = client.lrange(queue, 0, -1)
        client.delete(queue)
    finally:
        client.close()
    out = []
    for message in reversed(raw):  # kombu LPUSHes
        envelope = json.loads(message)
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        out.append((envelope["headers"]["task"], args))
    return out


def test_each_models_shards_go_to_its_own_queue(tmp_path, redis_url):
    queue = f"gpu-test-{uuid.uuid4().hex[:8]}"
    settings = load_settings(data_dir=tmp_path, broker_url=redis_url, celery_queue=queue,
                             models=["smollm2-135m-instruct", "/models/all-minilm-l6-v2"])
    assert worker_queues(settings) == [queue, f"{queue}.smollm2-135m-instruct", f"{queue}.all-minilm-l6-v2"]
    app = make_celery(settings)
    assert {q.name for q in app.conf.task_queues} == {*worker_queues(settings), settings.sweep_queue}
    dispatcher = CeleryDispatcher(app, queue, settings)
    dispatcher.batch_ready("batch_chat", ["s1", "s2"], model="smollm2-135m-instruct")
    dispatcher.batch_ready("batch_emb", ["s3"], model="all-minilm-l6-v2")
    dispatcher.batch_ready("batch_old", ["s4"])  # no model known: the queue every worker consumes
    assert queued(redis_url, shard_queue(settings, "smollm2-135m-instruct")) == [(RUN_SHARD, ["s1"]),
                                                                                 (RUN_SHARD, ["s2"])]
    assert queued(redis_url, shard_queue(settings, "all-minilm-l6-v2")) == [(RUN_SHARD, ["s3"])]
    assert queued(redis_url, queue) == [(RUN_SHARD, ["s4"])]


def set_model(ctx, batch_id: str, model: str) -> None:
    """The batch's model and its shards', as validation fills them."""
    with session_scope(ctx.sessions) as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(model=model))
        session.execute(update(Shard).where(Shard.batch_id == batch_id).values(model=model))


def test_a_worker_claims_only_the_shards_of_its_models(pg_jobs):
    chat, (chat_shard,) = make_batch(pg_jobs, 1)
    emb, (emb_shard,) = make_batch(pg_jobs, 1)
    set_model(pg_jobs, chat, "chat-model")
    set_model(pg_jobs, emb, "embedding-model")
    assert leases.claim(pg_jobs, chat_shard, "encoder-worker", ["embedding-model"]) is None
    claimed = leases.claim_next(pg_jobs, "encoder-worker", ["embedding-model"])
    assert (claimed.id, claimed.model) == (emb_shard, "embedding-model")
    assert leases.claim_next(pg_jobs, "encoder-worker", ["embedding-model"]) is None
    assert leases.claim(pg_jobs, chat_shard, "chat-worker", ["chat-model"]).model == "chat-model"
    assert leases.models_of(pg_jobs, [chat_shard, emb_shard]) == {"chat-model": [chat_shard],
                                                                  "embedding-model": [emb_shard]}

"""The Celery app for long GPU work, built from settings (never at import).

Only ``batchapi worker`` registers the shard task (``tasks.register``) and only ``batchapi beat``
the sweep (``beat.register``); the API sends tasks by name and never loads the engine.

Tasks carry shard ids only; the database is the source of truth and a message is a wake-up.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged only after its
  shard is done, so a worker that dies mid-shard leaves it for another one;
- ``worker_prefetch_multiplier=1``: a worker never hoards messages it cannot start;
- the Redis visibility timeout is longer than any shard, so a slow shard's message is not
  handed to a second worker while the first still runs it (were it so, the claim refuses it);
- shard tasks go to their model's queue (``shard_queue``: ``<BATCHAPI_CELERY_QUEUE>.<model id>``,
  e.g. ``gpu.all-minilm-l6-v2``), which the workers serving that model consume; a shard whose
  model is unknown goes to ``BATCHAPI_CELERY_QUEUE`` itself (default ``gpu``), which every worker
  consumes; sweeps go to another (``<that queue>-sweep``), so a sweep never waits behind a long shard.
"""

from __future__ import annotations

import logging

from celery import Celery
from kombu import Queue
from kombu.exceptions import OperationalError as BrokerError

from batchapi.config import Settings
from batchapi.models.registry import served_ids

log = logging.getLogger(__name__)

RUN_SHARD = "batchapi.run_shard"
SWEEP = "batchapi.sweep"


def make_celery(settings: Settings) -> Celery:
    app = Celery("batchapi", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_seconds},
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a Redis restart is waited out, not fatal
        # each queue its own routing key: by default they would share one and both get every task
        task_queues=[Queue(name, routing_key=name) for name in (*worker_queues(settings), settings.sweep_queue)],
        task_default_queue=settings.celery_queue,
        task_routes={RUN_SHARD: {"queue": settings.celery_queue}, SWEEP: {"queue": settings.sweep_queue}},
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_expires=None,  # no result backend, so beat schedules no daily backend cleanup task
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app


def shard_queue(settings: Settings, model: str | None) -> str:
    """The queue of a model's shards (``BATCHAPI_CELERY_QUEUE`` itself for an unknown model)."""
    return settings.celery_queue if model is None else f"{settings.celery_queue}.{model}"


def worker_queues(settings: Settings) -> list[str]:
    """What ``batchapi worker`` consumes: the queues of its models, and the catch-all queue."""
    return [settings.celery_queue, *(shard_queue(settings, model) for model in served_ids(settings))]


class CeleryDispatcher:
    """The API's dispatcher when a broker is configured: one task per shard, by name, on the
    queue of the batch's model (``queue``, the catch-all, when the model is not given)."""

    def __init__(self, app: Celery, queue: str, settings: Settings | None = None):
        self.app = app
        self.queue = queue
        self.settings = settings

    def queue_for(self, model: str | None) -> str:
        if model is None or self.settings is None:
            return self.queue
        return shard_queue(self.settings, model)

    def batch_ready(self, batch_id: str, shard_ids: list[str], model: str | None = None) -> None:
        try:
            send_shards(self.app, self.queue_for(model), shard_ids)
        except (BrokerError, OSError):
            # the shards are committed as queued: workers polling the database still find them
            log.warning("broker unavailable; batch %s waits for the workers' next poll", batch_id, exc_info=True)

    def batch_cancelled(self, batch_id: str) -> None:
        # workers see the status within a second and abort the batch's requests themselves
        log.info("batch %s cancelling", batch_id)


def send_shards(app: Celery, queue: str, shard_ids: list[str]) -> None:
    for shard_id in shard_ids:
        app.send_task(RUN_SHARD, args=[shard_id], queue=queue, retry_policy={"max_retries": 2})

"""The target of ``celery -A batchapi.workers.flower_app flower`` (Celery Flower watching the
workers): the Celery app built from the environment's settings when Celery imports this module,
which is this module's only use. Nothing of batchapi imports it."""

from __future__ import annotations

from batchapi.config import load_settings
from batchapi.workers.celery_app import make_celery

app = make_celery(load_settings())

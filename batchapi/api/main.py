"""The FastAPI app, built by ``create_app(settings)``; nothing happens at import time."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext

from fastapi import FastAPI

from batchapi.api import errors
from batchapi.api.routes import batches, files, health, models
from batchapi.api.schemas import ModelObject
from batchapi.config import Settings
from batchapi.jobs.context import Jobs, open_jobs
from batchapi.jobs.db import session_scope
from batchapi.jobs.dispatch import Dispatcher
from batchapi.jobs.ids import now
from batchapi.jobs.keys import DEFAULT_PROJECT, get_or_create_project
from batchapi.jobs.served_model import served_model_id
from batchapi.jobs.storage import Storage
from batchapi.jobs.validation_runner import ValidationRunner

log = logging.getLogger(__name__)

Hook = Callable[[Jobs], AbstractContextManager]


def create_app(
    settings: Settings,
    *,
    dispatcher: Dispatcher | None = None,
    storage: Storage | None = None,
    hook: Hook | None = None,
) -> FastAPI:
    """The API. ``dispatcher`` hears about validated and cancelled batches; ``hook(jobs)`` is a
    context manager entered for the app's lifetime (the embedded worker runs inside it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        jobs = open_jobs(settings, dispatcher=dispatcher, storage=storage)
        runner = ValidationRunner(jobs, settings.sweep_seconds)
        jobs.on_batch_created = runner.submit
        app.state.jobs = jobs
        app.state.model = ModelObject(id=served_model_id(settings), created=now())
        if not settings.auth_required:
            with session_scope(jobs.sessions) as session:
                app.state.default_project_id = get_or_create_project(session, DEFAULT_PROJECT).id
        runner.start()
        try:
            with hook(jobs) if hook else nullcontext():
                yield
        finally:
            runner.shutdown()
            jobs.close()

    app = FastAPI(title="batchapi", version="0.1.0", lifespan=lifespan)
    errors.install(app)
    for router in (files.router, batches.router, models.router, health.router):
        app.include_router(router)
    return app


def serve(settings: Settings, *, dispatcher: Dispatcher | None = None, hook: Hook | None = None) -> None:
    """``batchapi serve``: the API on settings.host:port (a SQLite database is migrated first)."""
    import uvicorn

    if settings.sqlalchemy_url.startswith("sqlite"):
        from batchapi.jobs.migrate import upgrade

        upgrade(settings)
    app = create_app(settings, dispatcher=dispatcher, hook=hook)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")

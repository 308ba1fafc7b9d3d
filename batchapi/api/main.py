"""The FastAPI app, built by ``create_app(settings)``; nothing happens at import time."""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext

import anyio
from fastapi import FastAPI

from batchapi import metrics
from batchapi.api import errors, openapi
from batchapi.api.limits import BodyLimit, server_options
from batchapi.api.multipart import FORM_OVERHEAD_BYTES, MAX_CONCURRENT_UPLOADS
from batchapi.api.request_id import RequestIdMiddleware
from batchapi.api.routes import (
    batches,
    dashboard,
    files,
    health,
    message_batches,
    models,
    uploads,
    usage,
    webhooks,
)
from batchapi.api.schemas import ModelObject
from batchapi.api.security_headers import SecurityHeaders
from batchapi.batches import messages
from batchapi.batches.sweeper import SweepLoop
from batchapi.config import Settings
from batchapi.context import Context, Dispatcher, open_context
from batchapi.db.clock import now
from batchapi.db.projects import DEFAULT_PROJECT, KeyCache, get_or_create_project
from batchapi.db.reads import open_reads
from batchapi.db.session import session_scope
from batchapi.models.registry import served_infos, served_model_id
from batchapi.storage import Storage
from batchapi.validation.runner import ValidationRunner

log = logging.getLogger(__name__)

Hook = Callable[[Context], AbstractContextManager]


def create_app(
    settings: Settings,
    *,
    dispatcher: Dispatcher | None = None,
    storage: Storage | None = None,
    hook: Hook | None = None,
    sweep_shards: bool = False,
    freeze_start_up: bool = False,
) -> FastAPI:
    """The API. ``dispatcher`` hears about validated and cancelled batches; ``hook(ctx)`` is a
    context manager entered for the app's lifetime (the embedded worker runs inside it). The API
    always sweeps for validations; ``sweep_shards`` adds the sweeper's shard steps, which are
    ``batchapi beat``'s in production and the embedded worker's host's without a broker.
    ``freeze_start_up``: the app has its process to itself (``batchapi serve``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = open_context(settings, dispatcher=dispatcher, storage=storage)
        runner = ValidationRunner(ctx)
        sweeper = SweepLoop(ctx, settings.sweep_seconds, runner, shards=sweep_shards)
        ctx.on_batch_created = runner.submit
        ctx.on_batch_cancelled = lambda _batch_id: sweeper.poke()
        app.state.ctx = ctx
        app.state.model = ModelObject(id=served_model_id(settings), created=now())  # the chat model
        app.state.models = [ModelObject(id=model, created=app.state.model.created, **dataclasses.asdict(info))
                            for model, info in served_infos(settings).items()]
        app.state.key_cache = KeyCache(settings.auth_cache_seconds)
        app.state.upload_limiter = anyio.CapacityLimiter(MAX_CONCURRENT_UPLOADS)
        app.state.reads = open_reads(settings)
        if app.state.reads is not None:
            await app.state.reads.open()
        if not settings.auth_required:
            with session_scope(ctx.sessions) as session:
                app.state.default_project_id = get_or_create_project(session, DEFAULT_PROJECT).id
        database_metrics = metrics.DatabaseCollector(ctx.sessions)
        registry.register(database_metrics)
        sweeper.start()
        try:
            with hook(ctx) if hook else nullcontext():
                if freeze_start_up:
                    # what start-up made (imports, the app, the settings) lives as long as the
                    # process: out of the collector's sight, a full collection no longer walks it
                    # (tens of ms on the loop, the polls' p99: docs/BENCHMARKS.md, "Polling");
                    # collected first, so no start-up garbage is kept for good
                    gc.collect()
                    gc.freeze()
                try:
                    yield
                finally:
                    sweeper.stop()  # before the embedded worker gives its shards back
        finally:
            registry.unregister(database_metrics)
            sweeper.stop()
            runner.shutdown()
            if app.state.reads is not None:
                await app.state.reads.close()
            ctx.close()

    # /docs with local assets: openapi.install serves it (FastAPI's own pulls Swagger UI from a CDN)
    app = FastAPI(title="batchapi", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    shared = settings.prometheus_multiproc_dir  # several API processes on one port
    app.state.metrics_registry = registry = metrics.api_registry(shared_dir=shared)
    app.add_middleware(batches.PollShortcut, state=app.state)  # the innermost of ours (added first)
    errors.install(app)
    app.add_middleware(BodyLimit, per_path={"/v1/files": settings.max_upload_bytes + FORM_OVERHEAD_BYTES,
                                            "/v1/messages/batches": messages.MAX_BODY_BYTES,
                                            uploads.PARTS_PATH: uploads.MAX_PART_BYTES + FORM_OVERHEAD_BYTES})
    app.add_middleware(metrics.HttpMetrics, registry=registry, shared=bool(shared))
    app.add_middleware(SecurityHeaders)  # CSP and framing for /dashboard, nosniff for all
    app.add_middleware(RequestIdMiddleware)  # outermost of ours: every response and log line has the id
    openapi.install(app)
    for router in (files.router, batches.router, message_batches.router, models.router, health.router):
        app.include_router(router)
    app.include_router(uploads.router)
    app.include_router(webhooks.router)
    for router in (usage.router, dashboard.router):
        app.include_router(router)
    dashboard.install(app)
    return app


def serve(settings: Settings, *, dispatcher: Dispatcher | None = None, hook: Hook | None = None,
          sweep_shards: bool = False, factory: str | None = None) -> None:
    """``batchapi serve``: the API on settings.host:port (a SQLite database is migrated first).
    With ``factory``, the import string of a function that builds the app from the environment,
    uvicorn runs settings.api_workers processes on the one port, each calling it."""
    import uvicorn

    if settings.sqlalchemy_url.startswith("sqlite"):
        from batchapi.db.migrate import upgrade

        upgrade(settings)
    # log_config None: uvicorn's loggers keep batchapi/logs.py's one format (cli.py set it up)
    options = dict(host=settings.host, port=settings.port, log_level="info", access_log=settings.access_log,
                   log_config=None)
    if factory is not None:
        with metrics.shared_across_processes(settings):
            uvicorn.run(factory, factory=True, workers=settings.api_workers, **options, **server_options())
        return
    app = create_app(settings, dispatcher=dispatcher, hook=hook, sweep_shards=sweep_shards, freeze_start_up=True)
    uvicorn.run(app, **options, **server_options())

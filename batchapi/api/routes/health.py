from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from batchapi import metrics
from batchapi.api.deps import ContextDep
from batchapi.api.schemas import Health, error_responses
from batchapi.batches.health import check_health

router = APIRouter(tags=["health"])


@router.get("/health", responses={**error_responses(400, 431), 503: {"model": Health, "description": "A dependency is down."}})
def health(ctx: ContextDep) -> JSONResponse:
    report = check_health(ctx)
    body = Health(status="ok" if report.ok else "unavailable", database=report.database, storage=report.storage)
    return JSONResponse(body.model_dump(), status_code=200 if report.ok else 503)


@router.get("/metrics", include_in_schema=False)
def prometheus_metrics(request: Request, ctx: ContextDep) -> Response:
    """Prometheus text format: the job tables' numbers and HTTP latency, plus the engine's gauges
    when this process runs one, or, in the embedded default, those its worker child serves on
    loopback (its dispatcher's ``metrics_text``). Sync: the database is read in a thread."""
    registries = [request.app.state.metrics_registry]
    engine = metrics.engine_stats()
    if engine.attached:
        registries.append(engine.registry)
    child = getattr(ctx.dispatcher, "metrics_text", None)
    return Response(metrics.exposition(*registries) + (child() if child else b""), media_type=CONTENT_TYPE_LATEST)

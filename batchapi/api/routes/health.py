from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from batchapi.api.deps import JobsDep
from batchapi.api.schemas import Health, error_responses
from batchapi.batches.health import check_health

router = APIRouter(tags=["health"])


@router.get("/health", responses={**error_responses(400, 431), 503: {"model": Health, "description": "A dependency is down."}})
def health(jobs: JobsDep) -> JSONResponse:
    report = check_health(jobs)
    body = Health(status="ok" if report.ok else "unavailable", database=report.database, storage=report.storage)
    return JSONResponse(body.model_dump(), status_code=200 if report.ok else 503)

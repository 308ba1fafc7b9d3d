from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from batchapi.api.deps import JobsDep
from batchapi.api.schemas import Health
from batchapi.batches.health import check_health

router = APIRouter(tags=["health"])


@router.get("/health", responses={503: {"model": Health}})
def health(jobs: JobsDep) -> JSONResponse:
    report = check_health(jobs)
    body = Health(status="ok" if report.ok else "unavailable", database=report.database, storage=report.storage)
    return JSONResponse(body.model_dump(), status_code=200 if report.ok else 503)

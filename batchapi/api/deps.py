"""Dependencies of the routes, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from batchapi.batches.context import Jobs
from batchapi.db.projects import authenticate


def get_jobs(request: Request) -> Jobs:
    return request.app.state.jobs


JobsDep = Annotated[Jobs, Depends(get_jobs)]


def get_project_id(request: Request, jobs: JobsDep) -> str:
    """The project of the request's API key (``Authorization: Bearer KEY``)."""
    if not jobs.settings.auth_required:
        return request.app.state.default_project_id
    scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
    with jobs.sessions() as session:
        return authenticate(session, key.strip() if scheme.lower() == "bearer" else None)


ProjectDep = Annotated[str, Depends(get_project_id)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=256)]

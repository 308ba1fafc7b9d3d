from __future__ import annotations

import asyncio
import re
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from batchapi.api.deps import ContextDep, IdempotencyKey, ProjectDep, bearer
from batchapi.api.errors import DATABASE_DOWN, database_down
from batchapi.api.schemas import (
    BatchDiffObject,
    BatchList,
    BatchObject,
    CreateBatchRequest,
    DryRunObject,
    DryRunRequest,
    error_responses,
)
from batchapi.batches import retry
from batchapi.batches import service as batches
from batchapi.batches.diff.compare import diff_batches
from batchapi.db.reads import AsyncReads, SqliteReads
from batchapi.validation.dry_run import dry_run

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=error_responses(400, 401, 404, 431))


@router.post("", responses=error_responses(409, 413))
def create_batch(
    ctx: ContextDep, project_id: ProjectDep, body: CreateBatchRequest, idempotency_key: IdempotencyKey = None
) -> BatchObject:
    batch = batches.create_batch(
        ctx, project_id, body.input_file_id, body.endpoint, body.completion_window, body.metadata, idempotency_key,
        output_expires_after=body.output_expires_after.model_dump() if body.output_expires_after else None,
        result_cache=body.result_cache, priority=body.priority, max_cost=body.max_cost,
    )
    return BatchObject.of(batch)


@router.post("/dry_run", responses=error_responses(429))
def dry_run_batch(ctx: ContextDep, project_id: ProjectDep, body: DryRunRequest) -> DryRunObject:
    """Extension (docs/API_EXTENSIONS.md): the file's line errors, exact prompt tokens, estimated
    cost and estimated completion, and whether the project's quota lets it start; runs nothing."""
    return DryRunObject.of(dry_run(ctx, project_id, body.input_file_id, body.endpoint, body.completion_window,
                                   body.priority))


@router.get("")
def list_batches(
    ctx: ContextDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    rows, has_more = batches.list_batches(ctx, project_id, limit, after)
    return BatchList.of([BatchObject.of(r) for r in rows], has_more)


@router.get("/{batch_id}", response_model=BatchObject)
async def retrieve_batch(request: Request, ctx: ContextDep, project_id: ProjectDep, batch_id: str) -> Response:
    """The polled route, serialized once rather than validated again against response_model: one
    plain SELECT on the event loop (``db.reads``: prepared and awaited on PostgreSQL, run at once
    on SQLite), and the batch rendered again only when its row changed since the last poll. An
    in-memory SQLite (no reads) takes one query on a thread of the loop's own small executor."""
    reads: AsyncReads | SqliteReads | None = request.app.state.reads
    if reads is None:
        loop = asyncio.get_running_loop()
        batch = await loop.run_in_executor(None, batches.get_batch, ctx, project_id, batch_id)
        return Response(_render(batch), media_type="application/json")
    body = await reads.rendered(project_id, batch_id, _render)
    if body is None:
        raise batches.batch_not_found(batch_id)
    return Response(body, media_type="application/json")


def _render(batch) -> bytes:
    return BatchObject.of(batch).model_dump_json().encode()


POLLED = re.compile(r"/v1/batches/(batch_[0-9a-f]+)")


class PollShortcut:
    """``retrieve_batch`` without the framework in between, for the one request a batch's owner
    sends most: ``GET /v1/batches/{id}`` with a key the key cache holds (or auth off), of a batch
    the reads find. Routing, dependency solving and the route's wrappers were two thirds of a
    poll's API CPU (docs/BENCHMARKS.md, "Polling"); here the poll costs the read and the send.
    Anything else, a refusal or a miss included, goes on to the app, which answers it as ever; a
    database that cannot be reached gets the app's 503 here. A pure ASGI middleware inside the others (request id, security headers, HTTP
    metrics), so the response carries what theirs does; ``scope["route"]`` is the route's own, for
    the metrics."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state
        self.route = next(r for r in router.routes if getattr(r, "endpoint", None) is retrieve_batch)

    async def __call__(self, scope, receive, send):
        found = POLLED.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "GET" else None
        reads: AsyncReads | SqliteReads | None = getattr(self.state, "reads", None) if found else None
        project_id = self._project(scope) if reads is not None else None
        try:
            body = await reads.rendered(project_id, found.group(1), _render) if project_id is not None else None
        except DATABASE_DOWN as exc:  # answered here: the app would wait for the same pool again
            return await (await database_down(None, exc))(scope, receive, send)
        if body is None:
            return await self.app(scope, receive, send)
        scope["route"] = self.route
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    def _project(self, scope) -> str | None:
        """``deps.get_project_id``'s answer when it needs no query; else None."""
        if not self.state.ctx.settings.auth_required:
            return self.state.default_project_id
        for name, value in scope["headers"]:
            if name == b"authorization":
                key = bearer(value.decode("latin-1"))
                return self.state.key_cache.get(key) if key else None
        return None


@router.post("/{batch_id}/cancel", responses=error_responses(409))
def cancel_batch(ctx: ContextDep, project_id: ProjectDep, batch_id: str) -> BatchObject:
    return BatchObject.of(batches.cancel_batch(ctx, project_id, batch_id))


@router.post("/{batch_id}/retry", responses=error_responses(409, 503))
def retry_batch(
    ctx: ContextDep, project_id: ProjectDep, batch_id: str, idempotency_key: IdempotencyKey = None
) -> BatchObject:
    """Extension (docs/API_EXTENSIONS.md): a new batch over the ended batch's failed, expired and
    cancelled requests."""
    return BatchObject.of(retry.retry_batch(ctx, project_id, batch_id, idempotency_key))


@router.get("/{batch_id}/partial_results", response_class=StreamingResponse, responses=error_responses(503))
def partial_results(
    ctx: ContextDep, project_id: ProjectDep, batch_id: str, kind: Literal["output", "error"] = "output"
) -> StreamingResponse:
    """Extension (docs/API_EXTENSIONS.md): result lines of the shards finished so far."""
    chunks = batches.iter_partial_results(ctx, project_id, batch_id, kind)
    return StreamingResponse(chunks, media_type="application/jsonl")


@router.get("/{batch_id}/diff", responses=error_responses(409, 503))
def diff_batch(
    ctx: ContextDep,
    project_id: ProjectDep,
    batch_id: str,
    against: Annotated[str, Query(min_length=1, max_length=64)],
    limit: Annotated[int, Query(ge=1, le=10000)] = 100,
) -> BatchDiffObject:
    """Extension (docs/API_EXTENSIONS.md): the requests whose results differ between two ended
    batches, by custom_id, and whether an output changed under the same system_fingerprint."""
    return BatchDiffObject.of(diff_batches(ctx, project_id, batch_id, against, limit))

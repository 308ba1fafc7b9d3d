"""Anthropic's Message Batches API (docs/API_EXTENSIONS.md): the same batches, Anthropic's wire format."""

from __future__ import annotations

import tempfile
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from batchapi.api.deps import AnthropicProjectDep, ContextDep
from batchapi.api.message_schemas import DeletedMessageBatch, MessageBatch, MessageBatchList, error_responses
from batchapi.api.schemas import error_responses as openai_error_responses
from batchapi.batches import messages

SPOOL_BYTES = 1024 * 1024  # a body past this is spooled to disk
# a request head too large is refused before any route, in the OpenAI shape (api/limits.py)
router = APIRouter(prefix="/v1/messages/batches", tags=["message batches"],
                   responses={**error_responses(400, 401, 404), **openai_error_responses(431)})


@router.post("", responses=error_responses(413, 429))
async def create_message_batch(request: Request, ctx: ContextDep, project_id: AnthropicProjectDep) -> MessageBatch:
    """Body: ``{"requests": [{"custom_id", "params"}]}``, read by hand: a problem in one request's
    ``params`` is that request's errored result, not a refusal of the batch. The body goes to a
    temporary file as it arrives, and is read from there a request at a time (``batches.messages``)."""
    with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as body:
        async for chunk in request.stream():
            body.write(chunk)
        body.seek(0)
        batch = await run_in_threadpool(messages.create, ctx, project_id, body)
    return MessageBatch.of(batch, _base_url(request, ctx))


@router.get("")
def list_message_batches(
    request: Request,
    ctx: ContextDep,
    project_id: AnthropicProjectDep,
    before_id: str | None = None,
    after_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> MessageBatchList:
    rows, has_more = messages.list_page(ctx, project_id, limit, after_id, before_id)
    data = [MessageBatch.of(r, _base_url(request, ctx)) for r in rows]
    return MessageBatchList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                            last_id=data[-1].id if data else None)


@router.get("/{message_batch_id}")
def retrieve_message_batch(request: Request, ctx: ContextDep, project_id: AnthropicProjectDep,
                           message_batch_id: str) -> MessageBatch:
    return MessageBatch.of(messages.get(ctx, project_id, message_batch_id), _base_url(request, ctx))


@router.post("/{message_batch_id}/cancel", responses=error_responses(409))
def cancel_message_batch(request: Request, ctx: ContextDep, project_id: AnthropicProjectDep,
                         message_batch_id: str) -> MessageBatch:
    return MessageBatch.of(messages.cancel(ctx, project_id, message_batch_id), _base_url(request, ctx))


@router.delete("/{message_batch_id}", responses=error_responses(503))
def delete_message_batch(ctx: ContextDep, project_id: AnthropicProjectDep, message_batch_id: str) -> DeletedMessageBatch:
    return DeletedMessageBatch(id=messages.delete(ctx, project_id, message_batch_id))


@router.get("/{message_batch_id}/results", response_class=StreamingResponse, responses=error_responses(503))
def message_batch_results(ctx: ContextDep, project_id: AnthropicProjectDep, message_batch_id: str) -> StreamingResponse:
    """JSONL, one line per request, for an ended batch: ``{"custom_id", "result"}``."""
    return StreamingResponse(messages.iter_results(ctx, project_id, message_batch_id),
                             media_type="application/binary")


def _base_url(request: Request, ctx) -> str:
    """Where clients reach the API, for the links handed out: ``BATCHAPI_PUBLIC_URL``; else the
    request's own scheme and host if its Host is one of ``BATCHAPI_TRUSTED_HOSTS``; else the
    server's own address: the one the connection reached (``BATCHAPI_HOST:BATCHAPI_PORT`` where
    the server does not say). A Host header is the client's to write: a link never follows one
    that the deployment did not name."""
    settings = ctx.settings
    if settings.public_url:
        return settings.public_url
    if request.headers.get("host", "").lower() in settings.trusted_hosts:  # as listed: a port only if named
        return str(request.base_url)
    host, port = request.scope.get("server") or (settings.host, settings.port)
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"http://{host}:{port}/"

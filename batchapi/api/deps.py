"""Dependencies of the routes, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool

from batchapi.context import Context
from batchapi.db.projects import Identity, KeyCache, authenticate, identify


async def get_context(request: Request) -> Context:  # async: no threadpool round trip for a lookup
    return request.app.state.ctx


ContextDep = Annotated[Context, Depends(get_context)]


def bearer(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header; None for another scheme or none."""
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


async def get_project_id(request: Request, ctx: ContextDep) -> str:
    """The project of the request's API key (``Authorization: Bearer KEY``). Async, so that a key
    seen in the last BATCHAPI_AUTH_CACHE_SECONDS costs neither a thread nor a query."""
    return await _project_of(request, ctx, bearer(request.headers.get("authorization")))


async def get_anthropic_project_id(request: Request, ctx: ContextDep) -> str:
    """As ``get_project_id``, for the Anthropic routes: the key in ``x-api-key`` (or a Bearer token).
    ``anthropic-version`` is accepted whatever it says."""
    key = (request.headers.get("x-api-key") or "").strip()
    if key:
        return await _project_of(request, ctx, key)
    return await get_project_id(request, ctx)


async def _project_of(request: Request, ctx: Context, key: str | None) -> str:
    if not ctx.settings.auth_required:
        return request.app.state.default_project_id
    cache: KeyCache = request.app.state.key_cache
    project_id = cache.get(key) if key else None
    if project_id is None:
        project_id = await run_in_threadpool(_authenticate, ctx, key)
        cache.put(key, project_id)
    return project_id


def _authenticate(ctx: Context, key: str | None) -> str:
    with ctx.sessions() as session:
        return authenticate(session, key)


async def get_identity(request: Request, ctx: ContextDep) -> Identity:
    """The request's key with its admin flag (the organization reports; not cached: rarely called).
    With auth off (``BATCHAPI_AUTH_REQUIRED=false``), an admin of the default project."""
    if not ctx.settings.auth_required:
        return Identity("", request.app.state.default_project_id, True)
    return await run_in_threadpool(_identify, ctx, bearer(request.headers.get("authorization")))


def _identify(ctx: Context, key: str | None) -> Identity:
    with ctx.sessions() as session:
        return identify(session, key)


ProjectDep = Annotated[str, Depends(get_project_id)]
IdentityDep = Annotated[Identity, Depends(get_identity)]
AnthropicProjectDep = Annotated[str, Depends(get_anthropic_project_id)]
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=256)]

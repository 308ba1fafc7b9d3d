"""OpenAI's Usage and Costs APIs: ``/v1/organization/usage/{completions,embeddings}`` and
``/v1/organization/costs``. A project's key reads its own project; an admin key
(``batchapi keys create --admin``) every project. See ``batchapi/reports.py``."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool

from batchapi import reports
from batchapi.api.deps import ContextDep, IdentityDep
from batchapi.api.schemas import error_responses
from batchapi.context import Context
from batchapi.db.projects import Identity

router = APIRouter(prefix="/v1/organization", tags=["usage"], responses=error_responses(400, 401, 431))

LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z
StartTime = Annotated[int, Query(ge=0, le=LAST_SECOND, description="Start of the range, Unix seconds, inclusive.")]
EndTime = Annotated[int | None, Query(ge=0, le=LAST_SECOND,
                                      description="End of the range, Unix seconds, exclusive; default now.")]
Width = Annotated[Literal["1m", "1h", "1d"], Query(description="Bucket width.")]
Limit = Annotated[int | None, Query(description="Buckets per page.")]
Page = Annotated[str | None, Query(max_length=200, description="A next_page of the previous answer.")]


def _listed(request: Request, name: str) -> list[str] | None:
    """A list parameter as OpenAI's SDKs send it (``name[]=a&name[]=b``), repeated (``name=a``) or
    comma-separated."""
    values = request.query_params.getlist(name) + request.query_params.getlist(f"{name}[]")
    items = [item.strip() for value in values for item in value.split(",") if item.strip()]
    return items or None


def _query(request: Request, start_time: int, end_time: int | None, bucket_width: str, limit: int | None,
           page: str | None, batch: bool | None = None) -> reports.Query:
    return reports.Query(start_time=start_time, end_time=end_time, bucket_width=bucket_width,
                         group_by=_listed(request, "group_by") or [], project_ids=_listed(request, "project_ids"),
                         models=_listed(request, "models"), batch=batch, limit=limit, page=page)


def _visible(identity: Identity) -> list[str] | None:
    return None if identity.admin else [identity.project_id]


def _usage(ctx: Context, query: reports.Query, kind: str, identity: Identity) -> dict:
    with ctx.sessions() as session:
        return reports.usage_page(session, query, kind, _visible(identity))


def _costs(ctx: Context, query: reports.Query, identity: Identity) -> dict:
    with ctx.sessions() as session:
        return reports.costs_page(session, query, _visible(identity))


@router.get("/usage/completions")
async def usage_completions(request: Request, ctx: ContextDep, identity: IdentityDep, start_time: StartTime,
                            end_time: EndTime = None, bucket_width: Width = "1d", limit: Limit = None,
                            page: Page = None, batch: bool | None = None) -> dict:
    """Tokens and succeeded requests per bucket (chat completions, completions, responses, messages);
    ``group_by`` any of ``project_id``, ``model``, ``batch``; filters ``project_ids``, ``models``."""
    query = _query(request, start_time, end_time, bucket_width, limit, page, batch)
    return await run_in_threadpool(_usage, ctx, query, "completions", identity)


@router.get("/usage/embeddings")
async def usage_embeddings(request: Request, ctx: ContextDep, identity: IdentityDep, start_time: StartTime,
                           end_time: EndTime = None, bucket_width: Width = "1d", limit: Limit = None,
                           page: Page = None) -> dict:
    """Input tokens and succeeded requests per bucket of embeddings batches."""
    query = _query(request, start_time, end_time, bucket_width, limit, page)
    return await run_in_threadpool(_usage, ctx, query, "embeddings", identity)


@router.get("/costs")
async def costs(request: Request, ctx: ContextDep, identity: IdentityDep, start_time: StartTime,
                end_time: EndTime = None, bucket_width: Literal["1d"] = "1d", limit: Limit = None,
                page: Page = None) -> dict:
    """Spend per day at the batch price (``amount.value`` in ``currency``); ``group_by`` any of
    ``project_id``, ``line_item`` (``<model>, input`` / ``cached input`` / ``output``)."""
    query = _query(request, start_time, end_time, bucket_width, limit, page)
    return await run_in_threadpool(_costs, ctx, query, identity)

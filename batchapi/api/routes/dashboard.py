"""``/dashboard``: a project's batches with live progress, one batch's page, two runs compared, and
daily usage charts.

Sign-in takes an API key (form field ``api_key``) and answers with a random session token in an
HttpOnly, SameSite=Strict cookie (the key itself never reaches the browser's storage or a URL);
``batchapi.db.projects`` keeps only the token's hash. Pages are rendered on the server (Jinja2) and
read without JavaScript; ``static/dashboard.js`` only refreshes the progress of running batches
from ``/dashboard/progress``. Every asset is served from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI, Form, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from batchapi import reports
from batchapi.api.dashboard import charts, views
from batchapi.api.deps import ContextDep
from batchapi.batches import files, service
from batchapi.batches.diff.compare import diff_batches
from batchapi.batches.sharing import quotas
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.projects import (
    Identity,
    close_dashboard_session,
    dashboard_identity,
    open_dashboard_session,
    project_names,
)
from batchapi.db.session import session_scope
from batchapi.errors import Conflict, InvalidRequest, NotFound, Unauthenticated

HERE = Path(__file__).resolve().parents[1] / "dashboard"
COOKIE = "batchapi_session"
PREFIX = "/dashboard"
PAGE_SIZE = 50
DIFF_ROWS = 200  # changed requests listed on the diff page

router = APIRouter(prefix=PREFIX, include_in_schema=False)
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.globals.update(when=views.when, duration=views.duration, color_of=charts.color_of)


def install(app: FastAPI) -> None:
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")


# who is signed in


def _identity(ctx: Context, request: Request) -> Identity | None:
    return _who(ctx, request)[0]


def _who(ctx: Context, request: Request) -> tuple[Identity | None, str]:
    """The session's key (every project's own with auth off) and its project's name."""
    with ctx.sessions() as session:
        if not ctx.settings.auth_required:
            identity = Identity("", request.app.state.default_project_id, True)
        else:
            identity = dashboard_identity(session, request.cookies.get(COOKIE))
        if identity is None:
            return None, ""
        return identity, project_names(session, [identity.project_id]).get(identity.project_id, "")


async def _signed_in(request: Request, ctx: Context) -> tuple[Identity | None, str]:
    return await run_in_threadpool(_who, ctx, request)


def _page(request: Request, name: str, status: int = 200, **values) -> HTMLResponse:
    response = templates.TemplateResponse(request, name, values, status_code=status)
    response.headers["Cache-Control"] = "no-store"
    return response


def _sign_in_page(request: Request, ctx: Context, error: str | None = None, status: int = 200) -> HTMLResponse:
    return _page(request, "sign_in.html", status, error=error, auth=ctx.settings.auth_required)


# sign-in and sign-out


def _cross_site(request: Request) -> bool:
    """A form posted from another site (login CSRF: signing a victim into someone else's project).
    Browsers send Sec-Fetch-Site, and Origin on POSTs; a client that sends neither is not a browser."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return True
    origin = request.headers.get("origin")
    if origin is None:
        return False
    return origin == "null" or origin.split("://", 1)[-1] != request.headers.get("host", "")


@router.post("/sign-in")
def sign_in(request: Request, ctx: ContextDep, api_key: Annotated[str, Form(max_length=512)] = "") -> Response:
    if _cross_site(request):
        return _sign_in_page(request, ctx, "Sign in from this dashboard's own page.", 403)
    try:
        with session_scope(ctx.sessions) as session:
            token, _ = open_dashboard_session(session, api_key.strip(), ctx.settings.dashboard_session_hours * 3600)
    except Unauthenticated:
        return _sign_in_page(request, ctx, "That API key is not valid (unknown or revoked).", 401)
    response = RedirectResponse(PREFIX, status_code=303)
    response.set_cookie(COOKIE, token, max_age=int(ctx.settings.dashboard_session_hours * 3600), path=PREFIX,
                        httponly=True, samesite="strict", secure=_secure(request, ctx.settings.cookie_secure))
    return response


def _secure(request: Request, setting: str) -> bool:
    """``BATCHAPI_COOKIE_SECURE``; auto: the scheme uvicorn resolved, a trusted proxy's X-Forwarded-Proto included."""
    return request.url.scheme == "https" if setting == "auto" else setting == "true"


@router.post("/sign-out")
def sign_out(request: Request, ctx: ContextDep) -> Response:
    with session_scope(ctx.sessions) as session:
        close_dashboard_session(session, request.cookies.get(COOKIE))
    response = RedirectResponse(PREFIX, status_code=303)
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return response


# pages


@router.get("")
async def batches_page(request: Request, ctx: ContextDep, after: Annotated[str | None, Query(max_length=64)] = None):
    identity, project = await _signed_in(request, ctx)
    if identity is None:
        return _sign_in_page(request, ctx)
    try:
        rows, more = await run_in_threadpool(service.list_batches, ctx, identity.project_id, PAGE_SIZE, after)
    except NotFound:
        rows, more = [], False
    t = now()
    items = [views.batch_view(b, t) for b in rows]
    return _page(request, "batches.html", items=items, more=more, last=rows[-1].id if rows else None,
                 project=project, auth=ctx.settings.auth_required, section="batches")


@router.get("/batches/{batch_id}")
async def batch_page(request: Request, ctx: ContextDep, batch_id: str):
    identity, project = await _signed_in(request, ctx)
    if identity is None:
        return _sign_in_page(request, ctx)
    try:
        b = await run_in_threadpool(service.get_batch, ctx, identity.project_id, batch_id)
    except NotFound:
        return _page(request, "missing.html", 404, what=f"No batch {batch_id} in this project.", project=project,
                     auth=ctx.settings.auth_required)
    others, _ = await run_in_threadpool(service.list_batches, ctx, identity.project_id, PAGE_SIZE, None,
                                        endpoint=b.endpoint)
    return _page(request, "batch.html", **views.batch_view(b, now()), project=project,
                 auth=ctx.settings.auth_required, section="batches", comparable=views.comparable(b, others))


@router.get("/batches/{batch_id}/diff")
async def diff_page(request: Request, ctx: ContextDep, batch_id: str,
                    against: Annotated[str, Query(max_length=64)] = ""):
    """Two runs compared: the summary and the requests that changed (``batches.diff``)."""
    identity, project = await _signed_in(request, ctx)
    if identity is None:
        return _sign_in_page(request, ctx)
    try:
        if not against:
            raise InvalidRequest("Pick a batch to compare with on the batch's page.", "against")
        found = await run_in_threadpool(diff_batches, ctx, identity.project_id, batch_id, against, DIFF_ROWS)
    except (NotFound, Conflict, InvalidRequest) as exc:
        status = 404 if isinstance(exc, NotFound) else 409 if isinstance(exc, Conflict) else 400
        return _page(request, "missing.html", status, what=exc.message, project=project,
                     auth=ctx.settings.auth_required, title="Cannot compare")
    return _page(request, "diff.html", d=views.diff_view(found), project=project, auth=ctx.settings.auth_required,
                 section="batches")


@router.get("/usage")
async def usage_page(request: Request, ctx: ContextDep, days: Annotated[int, Query(ge=1, le=31)] = 14):
    identity, project = await _signed_in(request, ctx)
    if identity is None:
        return _sign_in_page(request, ctx)
    daily = await run_in_threadpool(_daily, ctx, identity.project_id, days)
    limits = await run_in_threadpool(_limits, ctx, identity.project_id)
    return _page(request, "usage.html", daily=daily, days=days, project=project, auth=ctx.settings.auth_required,
                 section="usage", limits=limits,
                 tokens_chart=charts.stacked_bars(daily.labels, daily.tokens, "Tokens per day by model", " tokens"),
                 spend_chart=charts.stacked_bars(daily.labels, daily.spend, "Spend per day by model",
                                                 f" {daily.currency}", fmt=charts.money))


def _daily(ctx: Context, project_id: str, days: int) -> views.DailyUsage:
    today = now() // views.DAY * views.DAY
    query = reports.Query(start_time=today - (days - 1) * views.DAY, end_time=today + views.DAY,
                          bucket_width="1d", group_by=["model"], limit=days)
    with ctx.sessions() as session:
        pages = [reports.usage_page(session, query, kind, [project_id]) for kind in ("completions", "embeddings")]
        spend = reports.spend_by_model(session, query, [project_id])
    return views.daily_usage(pages, spend, "usd")


def _limits(ctx: Context, project_id: str) -> list[dict]:
    with ctx.sessions() as session:
        return views.limits_view(quotas.overview(session, ctx.settings, project_id))


# the live parts and the files


@router.get("/progress")
async def progress(request: Request, ctx: ContextDep, ids: Annotated[str, Query(max_length=4096)] = ""):
    """Progress of the listed batches (comma-separated ids) for the pages' script."""
    identity = await run_in_threadpool(_identity, ctx, request)
    if identity is None:
        return JSONResponse({"error": {"message": "Not signed in.", "type": "invalid_request_error",
                                       "param": None, "code": "not_signed_in"}}, status_code=401)
    found = await run_in_threadpool(_progress, ctx, identity.project_id, ids.split(",")[:PAGE_SIZE])
    return JSONResponse({"data": found}, headers={"Cache-Control": "no-store"})


def _progress(ctx: Context, project_id: str, ids: list[str]) -> list[dict]:
    t, found = now(), []
    with ctx.sessions() as session:
        for batch_id in filter(None, (i.strip() for i in ids)):
            try:
                found.append(views.progress(service.get_batch_row(session, project_id, batch_id), t).as_dict())
            except NotFound:
                continue
    return found


@router.get("/files/{file_id}")
async def file_download(request: Request, ctx: ContextDep, file_id: str):
    identity, project = await _signed_in(request, ctx)
    if identity is None:
        return _sign_in_page(request, ctx, status=401)
    try:
        row, chunks = await run_in_threadpool(files.open_content, ctx, identity.project_id, file_id)
    except NotFound:
        return _page(request, "missing.html", 404, what=f"No file {file_id} in this project.", project=project,
                     auth=ctx.settings.auth_required)
    return StreamingResponse(chunks, media_type="application/jsonl", headers={
        "Content-Length": str(row.bytes), "Content-Disposition": f'attachment; filename="{row.id}.jsonl"'})

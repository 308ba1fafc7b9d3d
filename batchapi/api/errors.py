"""Every error leaves the API in the OpenAI shape: ``{"error": {message, type, param, code}}``, except
on Anthropic's routes (``/v1/messages/``), where it is Anthropic's: ``{"type": "error", "error":
{"type", "message"}}``, the type named by the status. Both carry the request's id
(``error.request_id`` in OpenAI's, a top-level ``request_id`` in Anthropic's, as Anthropic's own
API does) and the ``x-request-id`` header, even from the last-resort handler of a 500."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import psycopg
import psycopg_pool
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from batchapi.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    RateLimited,
    ServiceError,
    StorageError,
    Unauthenticated,
)
from batchapi.logs import request_id_var
from batchapi.storage.streams import TooLarge

log = logging.getLogger(__name__)

# the first class that matches wins: TooLarge is an InvalidRequest
STATUS = {NotFound: 404, TooLarge: 413, InvalidRequest: 400, Conflict: 409, Unauthenticated: 401, RateLimited: 429,
          StorageError: 503}
ANTHROPIC_PATHS = "/v1/messages/"
# Anthropic's error type for each status (any other 4xx is invalid_request_error, 5xx api_error)
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    request_id = request_id_var.get()
    if request_id is not None:
        body["error"]["request_id"] = request_id
        headers = {**(headers or {}), "x-request-id": request_id}
    return JSONResponse(body, status_code=status, headers=headers)


async def _jobs_error(_request: Request, exc: ServiceError) -> JSONResponse:
    status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 400)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return error_response(status, exc.message, exc.param, exc.code, type_, headers)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message, param = "We could not parse the JSON body of your request.", None
    elif param:
        message = f"{param}: {message}"
    return error_response(400, message, param, first.get("type"))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    messages = {404: "Not found.", 405: "Method not allowed."}
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else messages.get(exc.status_code, "error")
    type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:  # Starlette names the methods of the first route on the path only
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    return error_response(exc.status_code, message, None, None, type_, headers)


def _allowed_methods(request: Request) -> list[str]:
    def served(method: str) -> bool:
        scope = {**request.scope, "method": method}
        return any(route.matches(scope)[0] == Match.FULL for route in request.app.routes)

    return [method for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE") if served(method)]


async def _bad_value(_request: Request, exc: DataError) -> JSONResponse:
    # the database refused a value from the request (a NUL character, say): bad input, not a 5xx
    log.info("database refused a request value: %s", exc.orig)
    return error_response(400, "The request holds a value that cannot be stored.", None, "invalid_value")


class RejectNulMiddleware:
    """A NUL character in the path or query is never valid and PostgreSQL cannot hold it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and ("\x00" in scope["path"] or b"%00" in scope["query_string"]):
            response = error_response(400, "The URL holds a NUL character.", None, "invalid_value")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# the database is unreachable or out of connections (a 503 with Retry-After, ``database_down``)
DATABASE_DOWN = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.TimeoutError, psycopg.OperationalError,
                 psycopg_pool.PoolTimeout)


async def database_down(_request: Request | None, exc: Exception) -> JSONResponse:
    # the database is unreachable or out of connections: retry later, nothing was changed
    log.warning("database unavailable: %s", exc)
    return error_response(503, "The service's database is unavailable; please retry.", None,
                          "database_unavailable", "server_error", {"Retry-After": "1"})


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "The server had an error processing your request.", type_="server_error")


def anthropic_error(response: JSONResponse) -> JSONResponse:
    """An error response of the OpenAI shape in Anthropic's, with the same status and headers."""
    status = response.status_code
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error = json.loads(response.body)["error"]
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    body = {"type": "error", "error": {"type": kind, "message": error["message"]}}
    if "request_id" in error:
        body["request_id"] = error["request_id"]
    return JSONResponse(body, status_code=status, headers=headers)


Handler = Callable[[Request, Exception], Awaitable[JSONResponse]]


def _shaped(handler: Handler) -> Handler:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = await handler(request, exc)
        return anthropic_error(response) if request.url.path.startswith(ANTHROPIC_PATHS) else response

    return handle


def install(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _shaped(_jobs_error))
    app.add_exception_handler(RequestValidationError, _shaped(_validation_error))
    app.add_exception_handler(StarletteHTTPException, _shaped(_http_error))
    app.add_exception_handler(DataError, _shaped(_bad_value))
    for exc in DATABASE_DOWN:
        app.add_exception_handler(exc, _shaped(database_down))
    app.add_exception_handler(Exception, _shaped(_unexpected))
    app.add_middleware(RejectNulMiddleware)

"""``x-request-id`` on every response, in the logs (``batchapi.logs.request_id_var``) and in error
bodies. An id the caller sends is kept when it is a plain token (a gateway's ``x-request-id``,
else the client's ``X-Client-Request-Id``, which is also echoed as ``x-client-request-id``, as
OpenAI does); otherwise the API makes one, ``req_`` and 32 hex digits."""

from __future__ import annotations

import re
import secrets

from starlette.datastructures import MutableHeaders

from batchapi.logs import batch_id_var, request_id_var

PLAIN = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
BATCH_IN_PATH = re.compile(r"/v1/(?:messages/)?batches/([A-Za-z0-9_]+)")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


def _plain(value: bytes | None) -> str | None:
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    return text if PLAIN.fullmatch(text) else None


class RequestIdMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        client_id = _plain(headers.get(b"x-client-request-id"))
        request_id = _plain(headers.get(b"x-request-id")) or client_id or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        # set, not reset afterwards: each request runs in a task of its own, and the server's
        # last-resort error handler, outside this middleware, still reads it
        request_id_var.set(request_id)
        found = BATCH_IN_PATH.match(scope["path"])
        batch_id_var.set(found.group(1).replace("msgbatch_", "batch_", 1) if found else None)  # a row's id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                response_headers = MutableHeaders(scope=message)
                response_headers["x-request-id"] = request_id
                if client_id is not None:
                    response_headers["x-client-request-id"] = client_id
            await send(message)

        await self.app(scope, receive, send_with_id)

"""Bounds on what a request may make the server read: the head (request line and headers), checked
by the HTTP protocol before any header reaches the app, and the body, checked by an ASGI middleware
before and while it is read. Both refuse in the OpenAI error shape and close the connection, so
nothing more of the request is read."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchapi.api.errors import ANTHROPIC_PATHS, anthropic_error, error_response
from batchapi.api.request_id import new_request_id
from batchapi.storage.streams import TooLarge

MAX_HEAD_BYTES = 64 * 1024  # request line and headers of one request
MAX_JSON_BODY_BYTES = 1024 * 1024  # every body but an upload's (a batch's is a few KiB)
LINGER_SECONDS = 2.0  # how long a refused connection is drained before it closes

# a body that is never read to its end leaves the connection unusable for another request
CLOSE = (b"connection", b"close")


def head_too_large_response(request_id: str) -> bytes:
    """The 431, written before any ASGI middleware sees the request, so it carries its own id
    (always a fresh one: the headers that might name one were never parsed)."""
    body = json.dumps({"error": {
        "message": f"The request line and headers are larger than {MAX_HEAD_BYTES} bytes.",
        "type": "invalid_request_error", "param": None, "code": "request_header_fields_too_large",
        "request_id": request_id,
    }}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nx-request-id: %s\r\nconnection: close\r\n\r\n%s"
            % (len(body), request_id.encode(), body))


class HeadLimitProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on the head of a request: past ``MAX_HEAD_BYTES``
    the client gets a 431 at once. httptools itself has none and copies a growing header value on
    every read, so a 100 MB header ties up the event loop for seconds; h11's bound answers 400."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_bytes = 0
        self.in_head = False
        self.refused = False

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # draining until the connection closes
        super().data_received(data)
        if not self.in_head or self.transport.is_closing():
            return
        # the chunk may end the previous request too; counting all of it errs on the safe side
        self.head_bytes += len(data)
        if self.head_bytes > MAX_HEAD_BYTES:
            self.refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_head, self.head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self.in_head = False
        super().on_headers_complete()

    def refuse_head(self) -> None:
        """Answer 431, then read and drop what the client still sends for a moment before closing:
        closing at once with unread data resets the connection, and the client may lose the answer."""
        self.refused = True
        request_id = new_request_id()
        client = "{}:{}".format(*self.client) if self.client else "-"  # as uvicorn's access log names it
        self.logger.info("%s - 431: refused a request whose head passed %d bytes", client, MAX_HEAD_BYTES,
                         extra={"request_id": request_id})
        self.transport.write(head_too_large_response(request_id))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()


def server_options() -> dict:
    """The uvicorn options of every API server (``batchapi serve`` and the tests' live server)."""
    return {"http": HeadLimitProtocol}


class BodyLimit:
    """Caps a request body at ``default`` bytes, or ``per_path[path]``: a ``Content-Length`` over
    the cap is refused before the app runs, a body that grows past it (chunked) as soon as it does.
    Any response that leaves before its request body was read to the end closes the connection."""

    def __init__(self, app, *, default: int = MAX_JSON_BODY_BYTES, per_path: dict[str, int] | None = None):
        self.app = app
        self.default = default
        self.per_path = per_path or {}

    def _cap(self, path: str) -> int:
        """``per_path[path]``; a key with ``*`` (``/v1/uploads/*/parts``) is a pattern."""
        if path in self.per_path:
            return self.per_path[path]
        return next((cap for pattern, cap in self.per_path.items() if "*" in pattern and fnmatchcase(path, pattern)),
                    self.default)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared, chunked = None, False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = int(value) if value.isdigit() else None
            elif name == b"transfer-encoding":
                chunked = True
        if not chunked and not declared:
            return await self.app(scope, receive, send)  # no body: nothing to bound
        cap = self._cap(scope["path"])
        too_large = TooLarge(f"The request body is larger than {cap} bytes, the limit of {scope['path']}.",
                             None, "request_too_large")
        if declared is not None and declared > cap:
            return await send_refusal(send, too_large, scope["path"])

        received, complete, tripped, replaced = 0, False, False, False

        async def counted_receive():
            nonlocal received, complete, tripped
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    tripped = True
                    raise too_large
                complete = not message.get("more_body", False)
            return message

        async def closing_send(message):
            nonlocal replaced
            if message["type"] == "http.response.start":
                if tripped and message["status"] != 413:  # a handler turned the refusal into another error
                    replaced = True
                    return await send_refusal(send, too_large, scope["path"])
                if not complete:
                    message = {**message, "headers": [*message.get("headers", []), CLOSE]}
            elif replaced:
                return
            await send(message)

        await self.app(scope, counted_receive, closing_send)


async def send_refusal(send, exc: TooLarge, path: str) -> None:
    """The 413, in the wire format of the route refused (Anthropic's on its routes)."""
    response = error_response(413, exc.message, exc.param, exc.code)
    if path.startswith(ANTHROPIC_PATHS):
        response = anthropic_error(response)
    await send({"type": "http.response.start", "status": 413, "headers": [*response.raw_headers, CLOSE]})
    await send({"type": "http.response.body", "body": response.body})

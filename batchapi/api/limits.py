"""Bounds on what a request may make the server read: the head (request line and headers), checked
by the HTTP protocol before any header reaches the app, and the body, checked by an ASGI middleware
before and while it is read. Both refuse in the OpenAI error shape and close the connection, so
nothing more of the request is read."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
from fnmatch import fnmatchcase

import uvicorn

from batchapi.api.errors import ANTHROPIC_PATHS, anthropic_error, error_response
from batchapi.api.request_id import new_request_id
from batchapi.storage.streams import TooLarge

log = logging.getLogger(__name__)

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


class HeadLimitProtocol(asyncio.Protocol):
    """uvicorn's httptools protocol behind a bound on the head of a request: past ``MAX_HEAD_BYTES``
    the client gets a 431 at once. httptools itself has none and copies a growing header value on
    every read, so a 100 MB header ties up the event loop for seconds; h11's bound answers 400.

    Built on public interfaces, none of uvicorn's internals: uvicorn creates it as any protocol class
    given as ``http``; it creates the protocol that ``http="httptools"`` names with the same
    arguments and hands it every byte and event as asyncio would; and it finds where each head
    begins and ends with a parser of its own (httptools' public one, which copies nothing without
    header or body callbacks)."""

    def __init__(self, *args, **kwargs) -> None:
        import httptools  # both imports as head_limit_problem checks them
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        self.inner = HttpToolsProtocol(*args, **kwargs)  # uvicorn's arguments: config, server_state, ...
        self.heads = httptools.HttpRequestParser(self)  # calls on_message_begin and on_headers_complete
        self.parse_errors = (httptools.HttpParserError, httptools.HttpParserUpgrade)
        self.transport: asyncio.Transport | None = None  # set by connection_made
        self.head_bytes = 0
        self.in_head = False
        self.watching = True  # until the request is malformed or upgraded: the inner protocol takes over
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # draining until the connection closes
        self.inner.data_received(data)
        if self.watching:
            try:
                self.heads.feed_data(data)
            except self.parse_errors:
                self.watching = self.in_head = False  # the inner protocol refused it (400) or upgraded
        if not self.in_head or self.transport.is_closing():
            return
        # the chunk may end the previous request too; counting all of it errs on the safe side
        self.head_bytes += len(data)
        if self.head_bytes > MAX_HEAD_BYTES:
            self.refuse_head()

    def on_message_begin(self) -> None:
        self.in_head, self.head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self.in_head = False

    def refuse_head(self) -> None:
        """Answer 431, then read and drop what the client still sends for a moment before closing:
        closing at once with unread data resets the connection, and the client may lose the answer."""
        self.refused = True
        request_id = new_request_id()
        peer = self.transport.get_extra_info("peername")
        client = "{}:{}".format(*peer) if isinstance(peer, tuple) else "-"  # as uvicorn's access log names it
        logging.getLogger("uvicorn.error").info("%s - 431: refused a request whose head passed %d bytes", client,
                                                MAX_HEAD_BYTES, extra={"request_id": request_id})
        self.transport.write(head_too_large_response(request_id))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()


# where uvicorn's httptools protocol is gone: h11's public bound on the head, which answers 400
H11_FALLBACK = {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


def server_options() -> dict:
    """The uvicorn options of every API server (``batchapi serve`` and the tests' live server)."""
    problem = head_limit_problem()
    if problem is None:
        return {"http": HeadLimitProtocol}
    log.warning("no 431 head limit (%s): the server runs h11, whose bound on a head answers 400", problem)
    return H11_FALLBACK


@functools.cache
def head_limit_problem() -> str | None:
    """What keeps ``HeadLimitProtocol`` from running on the installed uvicorn, or None: it needs
    httptools and uvicorn's httptools protocol, created as uvicorn creates a protocol class.
    tests/api/test_header_limit.py fails on anything named here."""
    try:
        import httptools  # noqa: F401  (uvicorn[standard]'s parser)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as exc:
        return f"uvicorn {uvicorn.__version__} without its httptools protocol: {exc}"
    try:
        inspect.signature(HttpToolsProtocol).bind(config=None, server_state=None, app_state=None, _loop=None)
    except TypeError as exc:
        return f"uvicorn {uvicorn.__version__} creates its httptools protocol otherwise: {exc}"
    if not issubclass(HttpToolsProtocol, asyncio.Protocol):
        return f"uvicorn {uvicorn.__version__}'s httptools protocol is no asyncio.Protocol"
    return None


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

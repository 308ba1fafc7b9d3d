"""A real HTTP receiver for webhook tests: a ThreadingHTTPServer on a free port that records every
POST (body bytes and headers) and answers with the statuses it is told, 200 once they run out."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    body: bytes
    headers: dict[str, str]
    status: int  # what the receiver answered


@dataclass
class Receiver:
    port: int = 0
    statuses: list[int] = field(default_factory=list)  # answers to give, in order
    received: list[Received] = field(default_factory=list)
    body: bytes = b"ok"  # the body of every answer
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.received.append(Received(body, {k.lower(): v for k, v in self.headers.items()}, status))
                self.send_response(status)
                self.send_header("content-length", str(len(receiver.body)))
                self.end_headers()
                try:
                    self.wfile.write(receiver.body)
                except (BrokenPipeError, ConnectionResetError):  # the sender read what it wanted
                    pass

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

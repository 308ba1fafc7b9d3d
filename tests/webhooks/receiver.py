"""Real HTTP receivers for webhook tests: a ThreadingHTTPServer on a free port that records every
POST (body bytes and headers) and answers with the statuses it is told, 200 once they run out; and
one that never finishes answering."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    body: bytes
    headers: dict[str, str]
    status: int  # what the receiver answered


class Listening:
    """A receiver on 127.0.0.1:``port`` once its ``start`` ran, stopped (``stop``) as its ``with``
    block ends."""

    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class Receiver(Listening):
    port: int = 0
    statuses: list[int] = field(default_factory=list)  # answers to give, in order
    received: list[Received] = field(default_factory=list)
    body: bytes = b"ok"  # the body of every answer
    _server: ThreadingHTTPServer | None = None

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


@dataclass
class Stalling(Listening):
    """A receiver that takes each POST and never finishes answering it: with ``trickle`` a status
    line and then header lines, a byte every 0.2 s (each read ends well within any read timeout),
    else nothing at all. ``accepted`` counts the connections it took."""

    trickle: bool = False
    port: int = 0
    accepted: int = 0
    _listener: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stalling:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self.accepted += 1
            threading.Thread(target=self._stall, args=(conn,), daemon=True).start()

    def _stall(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            answer = b"HTTP/1.1 200 OK\r\n" + b"x-wait: 1\r\n" * 100_000
            for byte in answer:
                if self._stop.wait(0.2):
                    return
                if self.trickle:
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:  # the sender gave up
                        return

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

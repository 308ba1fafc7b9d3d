"""A client on a raw socket that counts what the server let it send before it answered, which no
HTTP library reports: the measure of "refused before the body was read"."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

SEND_BUFFER = 64 * 1024  # the client's socket buffer, kept small so `sent` is close to what the server took


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    sent: int  # bytes after the head that the socket took before the answer began
    seconds: float  # from the first byte sent to the answer's start

    def json(self):
        return json.loads(self.body)


def address(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    return parts.hostname, parts.port


def send_until_answered(base_url: str, head: bytes, body: Iterable[bytes], timeout: float = 60.0) -> Answer:
    """Send ``head``, then ``body`` chunk by chunk, until the server answers (or the body runs out);
    then read the whole answer."""
    sock = socket.create_connection(address(base_url), timeout=timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    start = time.monotonic()
    deadline = start + timeout
    chunks = iter(body)
    pending, sent, received, answered_at = head, -len(head), b"", None
    sock.setblocking(False)
    try:
        while time.monotonic() < deadline:
            want_write = pending is not None and answered_at is None
            readable, writable, _ = select.select([sock], [sock] if want_write else [], [], 1.0)
            if readable:
                try:
                    data = sock.recv(1 << 16)
                except ConnectionResetError:
                    break
                if not data:
                    break
                answered_at = answered_at or time.monotonic()
                received += data
                if complete(received):
                    break
            elif writable:
                try:
                    n = sock.send(pending)
                except (BrokenPipeError, ConnectionResetError):
                    pending = None  # the server closed; its answer may still be in our buffer
                    continue
                sent += n
                pending = pending[n:] or next(chunks, None)
        else:
            raise AssertionError(f"no answer within {timeout} s after sending {sent} body bytes")
    finally:
        sock.close()
    return parse(received, max(sent, 0), (answered_at or time.monotonic()) - start)


def complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def parse(data: bytes, sent: int, seconds: float) -> Answer:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), f"not an HTTP answer: {data[:200]!r}"
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Answer(int(lines[0].split()[1]), headers, body, sent, seconds)


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(chunks: Iterable[bytes]) -> Iterable[bytes]:
    """The chunks in HTTP/1.1 chunked transfer coding (no Content-Length)."""
    for chunk in chunks:
        yield b"%x\r\n%s\r\n" % (len(chunk), chunk)
    yield b"0\r\n\r\n"

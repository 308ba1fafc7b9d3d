"""What the operations middleware costs a request: ``RequestIdMiddleware`` (an id, its header, the
log context) and ``HttpMetrics`` (a latency histogram by route) around a trivial ASGI app, against
the bare app in the same run, called in-process (no sockets), so only the middleware is measured.

    .venv/bin/python bench/ops_middleware.py [--requests 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from batchapi.api.request_id import RequestIdMiddleware
from batchapi.metrics import HttpMetrics, api_registry

SCOPE = {"type": "http", "method": "GET", "path": "/v1/batches/batch_0123456789abcdef0123", "headers": [
    (b"host", b"127.0.0.1"), (b"authorization", b"Bearer sk-batch-x"), (b"accept", b"*/*")], "query_string": b""}


async def bare(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def run(app, n: int) -> float:
    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(_message):
        return None

    started = time.perf_counter()
    for _ in range(n):
        await app(dict(SCOPE), receive, send)
    return (time.perf_counter() - started) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    wrapped = RequestIdMiddleware(HttpMetrics(bare, api_registry()))
    for _ in range(args.repeat):
        peer = asyncio.run(run(bare, args.requests))
        ours = asyncio.run(run(wrapped, args.requests))
        print(f"bare app {peer * 1e6:.2f} us/request, with the middleware {ours * 1e6:.2f} us/request: "
              f"+{(ours - peer) * 1e6:.2f} us, ratio {ours / peer:.1f}")


if __name__ == "__main__":
    main()

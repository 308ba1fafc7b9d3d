"""A request head (request line and headers) past ``MAX_HEAD_BYTES`` gets a 431 in the OpenAI error
shape as soon as it passes the limit, and the server keeps answering everyone else meanwhile."""

from __future__ import annotations

import io
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from batchapi.api.limits import (
    H11_FALLBACK,
    MAX_HEAD_BYTES,
    HeadLimitProtocol,
    head_limit_problem,
    server_options,
)
from tests.api.raw_http import send_until_answered
from tests.utils.batch_service import jsonl, request_line
from tests.utils.services import free_port

# the socket buffers on both ends hold this much before the server has even looked
READ_AHEAD = 2 << 20


def endless(piece: bytes):
    return itertools.repeat(piece * (65536 // len(piece)))


CASES = {
    "one endless header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", endless(b"a")),
    "a 1 MiB header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", [b"a" * (1 << 20) + b"\r\n\r\n"]),
    "many small headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n", endless(b"X-A: b\r\n")),
    "an endless URL": (b"GET /health?q=", endless(b"a")),
    "an authenticated upload's head": (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\nContent-Length: 10\r\nX-Big: ",
        endless(b"a")),
}


@pytest.mark.parametrize("case", CASES)
def test_an_oversized_head_gets_431_at_once(pg_server, case):
    head, rest = CASES[case]
    answer = send_until_answered(pg_server.base_url, head, rest, timeout=30)
    assert answer.status == 431, answer.body
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["code"] == "request_header_fields_too_large"
    assert error["request_id"] == answer.headers["x-request-id"]
    assert answer.headers["connection"] == "close"
    assert answer.sent < MAX_HEAD_BYTES + READ_AHEAD, answer.sent
    print(f"431 for {case}: {answer.sent} bytes taken, answered in {answer.seconds * 1000:.1f} ms")


def test_a_head_within_the_limit_is_served(pg_server):
    big = "a" * (MAX_HEAD_BYTES // 2)
    response = httpx.get(pg_server.base_url + "/health", headers={"X-Big": big})
    assert response.status_code == 200


def test_bodies_on_a_kept_alive_connection_do_not_count_as_head(pg_server, api_key, model_id):
    data = jsonl([request_line(f"r{i}", model_id, content="x" * 2000) for i in range(1500)])  # 3 MB
    assert len(data) > 40 * MAX_HEAD_BYTES
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {api_key}"}) as http:
        for _ in range(3):
            upload = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", io.BytesIO(data))})
            assert upload.status_code == 200, upload.text
            assert http.get(f"/v1/files/{upload.json()['id']}").status_code == 200


def test_health_stays_fast_while_oversized_heads_stream_in(pg_server):
    stop = threading.Event()
    refused = []

    def attack():
        while not stop.is_set():
            head, rest = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", endless(b"a")
            refused.append(send_until_answered(pg_server.base_url, head, rest, timeout=30).status)

    attackers = [threading.Thread(target=attack, daemon=True) for _ in range(2)]
    for thread in attackers:
        thread.start()
    latencies = []
    try:
        with httpx.Client(base_url=pg_server.base_url, timeout=10) as http:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                start = time.monotonic()
                assert http.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
    finally:
        stop.set()
        for thread in attackers:
            thread.join(timeout=30)
    assert refused and set(refused) == {431}
    latencies.sort()
    print(f"/health under {len(refused)} oversized heads: {len(latencies)} polls, "
          f"p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    assert latencies[-1] < 3.0  # before the limit, one 64 MB header stalled it for 7 s


def test_the_head_limit_runs_on_the_installed_uvicorn():
    """HeadLimitProtocol needs httptools and the protocol uvicorn's ``http="httptools"`` names, created
    as uvicorn creates a protocol class; an upgrade that takes either away fails here by name (the
    server itself would run h11's bound instead, which answers 400)."""
    assert head_limit_problem() is None, head_limit_problem()
    assert server_options() == {"http": HeadLimitProtocol}, f"uvicorn {uvicorn.__version__}"


async def echo_app(scope, receive, send):
    """Reads the whole body, answers 200 with its length: the protocol alone, no service."""
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(size).encode()})


@contextmanager
def bare_server(**options) -> Iterator[str]:
    """``echo_app`` under uvicorn with ``options`` on a free port in a thread; its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(echo_app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_on_a_bare_uvicorn_the_protocol_answers_431_and_serves_everything_else():
    """The same checks as above without the service: what an upgrade of uvicorn or httptools would
    break shows here, whatever else the app does."""
    with bare_server(**server_options()) as url:
        for case, (head, rest) in CASES.items():
            answer = send_until_answered(url, head, rest, timeout=30)
            assert answer.status == 431, (case, uvicorn.__version__, answer.body)
            assert answer.json()["error"]["code"] == "request_header_fields_too_large"
            assert answer.sent < MAX_HEAD_BYTES + READ_AHEAD, (case, answer.sent)
        body = b"x" * (3 << 20)
        with httpx.Client(base_url=url) as http:  # one kept-alive connection
            for _ in range(3):
                assert http.get("/", headers={"X-Big": "a" * (MAX_HEAD_BYTES // 2)}).status_code == 200
                assert http.post("/", content=body).text == str(len(body))
                assert http.post("/", content=iter([body[:1 << 20]] * 3)).text == str(len(body))  # chunked


def test_the_h11_fallback_bounds_the_head_with_a_400():
    """Where uvicorn's httptools protocol is gone, the server runs h11 with its public bound: a head
    past MAX_HEAD_BYTES is still refused before much more is read, in h11's 400."""
    with bare_server(**H11_FALLBACK) as url:
        head, rest = CASES["one endless header"]
        answer = send_until_answered(url, head, rest, timeout=30)
        assert answer.status == 400, answer.body
        assert answer.sent < MAX_HEAD_BYTES + READ_AHEAD, answer.sent
        response = httpx.get(url + "/", headers={"X-Big": "a" * (MAX_HEAD_BYTES // 2)})
        assert response.status_code == 200  # h11's own default bound is 16 KiB: the option is in force

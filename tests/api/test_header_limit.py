"""A request head (request line and headers) past ``MAX_HEAD_BYTES`` gets a 431 in the OpenAI error
shape as soon as it passes the limit, and the server keeps answering everyone else meanwhile."""

from __future__ import annotations

import io
import itertools
import threading
import time

import httpx
import pytest

from batchapi.api.limits import MAX_HEAD_BYTES
from tests.api.raw_http import send_until_answered
from tests.utils.batch_service import jsonl, request_line

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

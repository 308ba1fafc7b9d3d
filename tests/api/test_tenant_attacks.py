"""No tenant can hurt another (issue #31): each attack case with its measured bound.

- A Message Batches create body is read a request at a time: a 32 MiB body of one oversized
  request, or of valid requests, grows the API process by at most ``8 * max_line_bytes`` (it grew
  by 12x the body before, 400 MB for this one; bench/message_batch_memory.py measures both).
- Webhook tests hold none of the API's threads: with 120 of them waiting on a receiver that never
  answers, another project's ``GET /v1/files`` answers within a second (59 s before), and a
  project past its cap of tests in flight gets a 429.
- Every dashboard response forbids framing and inline script; every response says nosniff.
- A Message Batch's ``results_url`` never follows a Host header the deployment did not list.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
from starlette.requests import Request

from batchapi.api.routes import message_batches
from batchapi.api.routes.webhooks import TESTS_PER_PROJECT
from batchapi.api.security_headers import CONTENT_SECURITY_POLICY
from batchapi.openai.message_requests import line_head
from tests.utils.api_process import ApiProcess, oversized_body, valid_body
from tests.utils.batch_service import new_key
from tests.utils.services import fresh_database
from tests.utils.waiting import wait_until

MIB = 1024 * 1024
HUNG_TESTS = 120
ANTHROPIC = {"anthropic-version": "2023-06-01"}


# the Message Batches create body


@pytest.fixture(scope="module")
def api_process(tmp_path_factory, tiny_llama_dir):
    with fresh_database("batchapi_tenant") as database_url, \
            ApiProcess(tmp_path_factory.mktemp("tenant"), database_url, tiny_llama_dir) as api:
        for _ in range(3):  # lazy imports, pools, the first validation's tokenizer: not what is measured
            assert api.post_messages(valid_body(8, "m")).status_code == 200
        yield api


def test_an_oversized_request_is_refused_in_bounded_memory(api_process):
    body = oversized_body(32 * MIB)
    answer, growth = api_process.measure(body)
    assert growth < 8 * 4 * MIB, f"the API process grew by {growth / MIB:.1f} MiB for a {len(body) / MIB:.0f} MiB body"
    params = len(body) - len(b'{"requests":[{"custom_id":"big","params":') - len(b"}]}")
    size = len(line_head("big")) + params + len(b"}\n")  # its line, as the input file would hold it
    assert answer.status_code == 400
    assert answer.json()["error"] == {"type": "invalid_request_error",
                                      "message": f"requests.0: the request is {size} bytes; the limit is {4 * MIB}"}


def test_a_large_valid_body_is_read_in_bounded_memory(api_process):
    body = valid_body(16 * 1024, "m", 2048)  # 32 MiB: 16,384 requests
    answer, growth = api_process.measure(body)
    assert answer.status_code == 200 and answer.json()["request_counts"]["processing"] == 16 * 1024
    assert growth < 8 * 4 * MIB, f"the API process grew by {growth / MIB:.1f} MiB for a {len(body) / MIB:.0f} MiB body"


# webhook tests


class HungReceiver:
    """A TCP server on 127.0.0.1 that takes every connection and never answers."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks"
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def __enter__(self) -> HungReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def quick_timeout(pg_server, monkeypatch):
    ctx = pg_server.ctx
    monkeypatch.setattr(ctx, "settings", ctx.settings.model_copy(update={"webhook_timeout_seconds": 4.0}))


def test_hung_webhook_tests_hold_no_request_thread(pg_server, quick_timeout):
    projects = HUNG_TESTS // TESTS_PER_PROJECT  # each at its cap, so every test is in flight at once
    keys = [new_key(pg_server, f"hung-{i}") for i in range(projects)]
    bystander = {"Authorization": f"Bearer {new_key(pg_server, 'bystander')}"}
    with HungReceiver() as receiver, httpx.Client(base_url=pg_server.base_url) as http:
        endpoint_ids = [http.post("/v1/webhook_endpoints", headers={"Authorization": f"Bearer {key}"}, json={
            "url": receiver.url, "event_types": ["batch.completed"], "name": "hung"}).json()["id"] for key in keys]
        assert http.get("/v1/files", headers=bystander).status_code == 200

        async def attack() -> tuple[list[httpx.Response], float, httpx.Response]:
            async with httpx.AsyncClient(base_url=pg_server.base_url, timeout=60,
                                         limits=httpx.Limits(max_connections=HUNG_TESTS + 10)) as client:
                tests = [asyncio.ensure_future(client.post(
                    f"/v1/webhook_endpoints/{endpoint_id}/test", headers={"Authorization": f"Bearer {key}"},
                    json={"event_type": "batch.completed"}))
                    for key, endpoint_id in zip(keys, endpoint_ids, strict=True) for _ in range(TESTS_PER_PROJECT)]
                deadline = time.monotonic() + 20
                while len(receiver.held) < HUNG_TESTS:  # every test has reached the receiver
                    assert time.monotonic() < deadline, f"{len(receiver.held)} of {HUNG_TESTS} tests in flight"
                    await asyncio.sleep(0.05)
                over = await client.post(f"/v1/webhook_endpoints/{endpoint_ids[0]}/test",
                                         headers={"Authorization": f"Bearer {keys[0]}"},
                                         json={"event_type": "batch.completed"})
                started = time.monotonic()
                unrelated = await client.get("/v1/files", headers=bystander)
                took = time.monotonic() - started
                assert unrelated.status_code == 200
                return await asyncio.gather(*tests), took, over

        answers, took, over = asyncio.run(attack())
    assert took < 1.0, f"GET /v1/files took {took:.2f} s behind {HUNG_TESTS} hung webhook tests"
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "rate_limit_exceeded" and set(over.json()["error"]) >= {
        "message", "type", "param", "code"}
    assert {a.status_code for a in answers} == {400}  # each ended, unanswered, at the timeout
    assert {a.json()["error"]["code"] for a in answers} == {"webhook_endpoint_unreachable"}


@pytest.mark.parametrize("status", [302, 500])
def test_a_test_answered_otherwise_than_2xx_says_its_status(client, pg_server, status):
    received = []

    class Handler(threading.Thread):
        def __init__(self, sock):
            super().__init__(daemon=True)
            self.sock = sock

        def run(self):
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                received.append(conn.recv(65536))
                location = b"location: http://127.0.0.1:1/elsewhere\r\n" if status == 302 else b""
                conn.sendall(b"HTTP/1.1 %d No\r\n%scontent-length: 4\r\nconnection: close\r\n\r\nnope" % (status, location))
                conn.close()

    sock = socket.create_server(("127.0.0.1", 0))
    Handler(sock).start()
    try:
        created = client.webhooks.create(url=f"http://127.0.0.1:{sock.getsockname()[1]}/h",
                                         event_types=["batch.completed"], name="refusing")
        result = client.webhooks.test(created.id, event_type="batch.completed")
    finally:
        sock.close()
    # the receiver refused it: success says so, beside its own status
    assert (result.status_code, result.success) == (status, False)
    assert len(received) == 1  # a redirect is not followed


# the dashboard's headers


def test_every_dashboard_response_forbids_framing_and_inline_script(pg_server):
    assert "script-src" not in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY and "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
    with httpx.Client(base_url=pg_server.base_url) as http:
        answers = [http.get("/dashboard"), http.get("/dashboard/usage"), http.get("/dashboard/static/dashboard.js"),
                   http.get("/dashboard/progress?ids=batch_x"), http.get("/dashboard/no-such-page"),
                   http.post("/dashboard/sign-in", data={"api_key": "sk-batch-wrong"})]
        api = [http.get("/v1/models"), http.get("/health"), http.get("/v1/files")]
    assert [a.status_code for a in answers] == [200, 200, 200, 401, 404, 401]
    for answer in answers:
        assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, answer.url
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "same-origin"
    for answer in api:
        assert answer.headers["x-content-type-options"] == "nosniff" and "content-security-policy" not in answer.headers


# results_url


def _request(host: str, server: tuple[str, int] | None = ("127.0.0.9", 8080)) -> Request:
    """A request as uvicorn hands it over: ``server`` is the address its connection reached."""
    return Request({"type": "http", "method": "GET", "path": "/v1/messages/batches", "scheme": "http",
                    "server": server, "headers": [(b"host", host.encode())], "query_string": b""})


@pytest.mark.parametrize("public_url,trusted,host,link", [
    ("", [], "evil.example", "http://127.0.0.9:8080/"),  # forged: the server's own address
    ("", ["batch.internal:8080"], "batch.internal:8080", "http://batch.internal:8080/"),
    ("", ["batch.internal:8080"], "BATCH.internal:8080", "http://BATCH.internal:8080/"),  # names ignore case
    ("", ["batch.internal:8080"], "batch.internal:9999", "http://127.0.0.9:8080/"),  # a port not listed
    ("", ["batch.internal"], "evil.example", "http://127.0.0.9:8080/"),
    ("https://batch.example.com/api", ["evil.example"], "evil.example", "https://batch.example.com/api"),
])
def test_results_url_follows_only_a_configured_host(pg_server, public_url, trusted, host, link):
    settings = pg_server.ctx.settings.model_copy(update={"public_url": public_url, "trusted_hosts": trusted})
    ctx = type("Ctx", (), {"settings": settings})()
    assert message_batches._base_url(_request(host), ctx) == link


def test_without_the_servers_address_the_link_is_the_configured_one(pg_server):
    settings = pg_server.ctx.settings.model_copy(update={"host": "::", "port": 8000})
    ctx = type("Ctx", (), {"settings": settings})()
    assert message_batches._base_url(_request("evil.example", None), ctx) == "http://[::]:8000/"


def test_a_forged_host_gets_the_configured_link(pg_server, api_key, model_id):
    headers = {"x-api-key": api_key, **ANTHROPIC}
    with httpx.Client(base_url=pg_server.base_url, headers=headers) as http:
        created = http.post("/v1/messages/batches", json={"requests": [
            {"custom_id": "a", "params": {"model": model_id, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": "hi"}]}}]}).json()
        http.post(f"/v1/messages/batches/{created['id']}/cancel")

        def ended():
            answer = http.get(f"/v1/messages/batches/{created['id']}", headers={"Host": "evil.example"}).json()
            return answer if answer["processing_status"] == "ended" else None

        forged = wait_until(ended, 30, 0.2, "the cancelled batch to end")
    assert forged["results_url"] == f"{pg_server.base_url}/v1/messages/batches/{created['id']}/results"

"""``x-request-id`` on every response and in the error bodies of both wire shapes."""

from __future__ import annotations

import itertools
import logging
import re

import httpx
import pytest

from tests.api.raw_http import send_until_answered
from tests.utils.batch_service import new_key

GENERATED = re.compile(r"req_[0-9a-f]{32}")


@pytest.fixture
def http(pg_server):
    key = new_key(pg_server, "request-id-project")
    with httpx.Client(base_url=pg_server.base_url, headers={"Authorization": f"Bearer {key}"}) as client:
        yield client


def test_every_response_has_a_fresh_request_id(http):
    first, second = http.get("/v1/models"), http.get("/health")
    assert first.status_code == 200 and second.status_code == 200
    assert GENERATED.fullmatch(first.headers["x-request-id"])
    assert GENERATED.fullmatch(second.headers["x-request-id"])
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


def test_an_incoming_request_id_is_kept_and_a_bad_one_replaced(http):
    assert http.get("/v1/models", headers={"x-request-id": "gw-1234.abc"}).headers["x-request-id"] == "gw-1234.abc"
    client_id = http.get("/v1/models", headers={"X-Client-Request-Id": "client-42"})
    assert client_id.headers["x-request-id"] == "client-42"
    assert client_id.headers["x-client-request-id"] == "client-42"
    for bad in ("has spaces in it", "x" * 129, "<script>"):
        assert GENERATED.fullmatch(http.get("/v1/models", headers={"x-request-id": bad}).headers["x-request-id"])


def test_openai_error_bodies_carry_the_request_id(http):
    response = http.get("/v1/batches/batch_missing")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["request_id"] == response.headers["x-request-id"]
    assert GENERATED.fullmatch(error["request_id"])
    wrong = httpx.get(f"{http.base_url}/v1/files", headers={"Authorization": "Bearer sk-wrong", "x-request-id": "mine-1"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["request_id"] == "mine-1" == wrong.headers["x-request-id"]
    invalid = http.post("/v1/batches", json={"endpoint": 3})
    assert invalid.status_code == 400 and invalid.json()["error"]["request_id"] == invalid.headers["x-request-id"]


def test_anthropic_error_bodies_carry_request_id_at_the_top(http):
    response = http.get("/v1/messages/batches/msgbatch_missing", headers={"x-request-id": "anthropic-7"})
    assert response.status_code == 404
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert body["request_id"] == "anthropic-7" == response.headers["x-request-id"]
    assert "request_id" not in body["error"]


def test_refusals_before_the_route_carry_it_too(http):
    too_big = http.post("/v1/batches", content=b"{" * 2_000_000, headers={"content-type": "application/json"})
    assert too_big.status_code == 413
    assert too_big.json()["error"]["request_id"] == too_big.headers["x-request-id"]
    nul = http.get("/v1/batches/batch%00x")
    assert nul.status_code == 400 and nul.json()["error"]["request_id"] == nul.headers["x-request-id"]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_log():
    """uvicorn's own logger at INFO, where the server writes the 431s (it never reaches the app)."""
    logger, handler = logging.getLogger("uvicorn.error"), Records()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_431_carries_a_fresh_request_id_and_logs_it(pg_server, server_log):
    """The head limit answers from the HTTP protocol, before the middleware: the id is its own."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nx-request-id: mine-431\r\nX-Big: "
    ids = []
    for _ in range(2):
        answer = send_until_answered(pg_server.base_url, head, itertools.repeat(b"a" * 65536))
        assert answer.status == 431
        assert GENERATED.fullmatch(answer.headers["x-request-id"])
        assert answer.json()["error"]["request_id"] == answer.headers["x-request-id"]
        ids.append(answer.headers["x-request-id"])
    assert ids[0] != ids[1]
    logged = [r for r in server_log if "431" in r.getMessage()]
    assert [r.request_id for r in logged] == ids
    assert all(r.getMessage().startswith("127.0.0.1:") for r in logged)


def test_an_unexpected_error_still_answers_with_the_request_id(tmp_path):
    """The last-resort 500 leaves from outside every middleware; it still carries the id."""
    from fastapi.testclient import TestClient

    from batchapi.api.main import create_app
    from batchapi.config import load_settings

    app = create_app(load_settings(data_dir=tmp_path))

    @app.get("/boom")
    def boom():
        raise RuntimeError("a bug")

    client = TestClient(app, raise_server_exceptions=False)  # not entered: no lifespan, no database
    response = client.get("/boom", headers={"x-request-id": "bug-1"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "bug-1" == response.json()["error"]["request_id"]

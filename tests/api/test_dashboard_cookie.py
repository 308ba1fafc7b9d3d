"""The dashboard session cookie's Secure flag (``BATCHAPI_COOKIE_SECURE``): ``true`` sets it even on
plain http (TLS ends at a proxy the server does not trust), ``false`` never does, ``auto`` sets it
when the request is https as uvicorn sees it, an ``X-Forwarded-Proto: https`` counting only from a
peer in uvicorn's ``FORWARDED_ALLOW_IPS`` (loopback by default)."""

from __future__ import annotations

from contextlib import contextmanager

import httpx
import pytest

from batchapi.db.migrate import upgrade
from tests.utils.batch_service import live_server, new_key, service_settings

HTTPS_PROXY = {"X-Forwarded-Proto": "https"}


@contextmanager
def dashboard_server(tmp_path, model_dir, cookie_secure: str):
    settings = service_settings(tmp_path, model_dir, cookie_secure=cookie_secure)
    upgrade(settings)
    with live_server(settings) as server:
        yield server


@pytest.fixture(scope="module", params=["auto", "true", "false"])
def server(request, tmp_path_factory, tiny_llama_dir):
    with dashboard_server(tmp_path_factory.mktemp(f"cookie-{request.param}"), tiny_llama_dir, request.param) as server:
        yield request.param, server


def session_cookie(server, headers: dict | None = None) -> list[str]:
    """The attributes of the cookie a sign-in sets, lower-cased (``secure``, ``httponly``, ...)."""
    response = httpx.post(f"{server.base_url}/dashboard/sign-in", data={"api_key": new_key(server, "cookie")},
                          headers=headers or {}, follow_redirects=False)
    assert response.status_code == 303, response.text
    name_value, *attributes = (part.strip() for part in response.headers["set-cookie"].split(";"))
    assert name_value.startswith("batchapi_session=")
    return [attribute.lower() for attribute in attributes]


def test_the_secure_flag_follows_the_setting(server):
    setting, live = server
    expected = {"true": (True, True), "false": (False, False), "auto": (False, True)}[setting]
    over_http, behind_https_proxy = session_cookie(live), session_cookie(live, HTTPS_PROXY)
    assert ("secure" in over_http, "secure" in behind_https_proxy) == expected
    assert "httponly" in over_http and "samesite=strict" in over_http


def test_auto_ignores_forwarded_proto_from_an_untrusted_peer(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "192.0.2.1")  # uvicorn's own: the only proxy it trusts
    with dashboard_server(tmp_path, tiny_llama_dir, "auto") as live:
        assert "secure" not in session_cookie(live, HTTPS_PROXY)

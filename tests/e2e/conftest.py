"""The end-to-end tests: whole batches through the unmodified openai and anthropic SDKs against a live
service. Each module starts the ``server`` it needs (an embedded stack of its own settings, or the
shared ``pg_server`` of tests/conftest.py); these fixtures read it."""

from __future__ import annotations

import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def openai_client(server) -> OpenAI:
    """The openai SDK on the module's ``server`` (run with auth off)."""
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server) -> str:
    """The chat model the module's ``server`` serves."""
    return server.app.state.model.id

from __future__ import annotations

import pytest
from openai import OpenAI

from batchapi.db.migrate import upgrade
from batchapi.db.projects import create_api_key
from batchapi.db.session import session_scope
from tests.utils.batch_service import live_server, service_settings


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory, pg_url, s3, tiny_llama_dir):
    """One live server on PostgreSQL and SeaweedFS for the API tests; tests stay apart by project."""
    settings = service_settings(tmp_path_factory.mktemp("api-pg"), tiny_llama_dir, pg_url=pg_url, s3=s3)
    upgrade(settings)
    with live_server(settings) as server:
        yield server


@pytest.fixture(scope="session")
def sqlite_server(tmp_path_factory, tiny_llama_dir):
    settings = service_settings(tmp_path_factory.mktemp("api-sqlite"), tiny_llama_dir)
    upgrade(settings)
    with live_server(settings) as server:
        yield server


def new_key(server, project: str) -> str:
    with session_scope(server.ctx.sessions) as session:
        return create_api_key(session, project)


@pytest.fixture
def api_key(pg_server, request) -> str:
    return new_key(pg_server, f"project-{request.node.name}")


@pytest.fixture
def client(pg_server, api_key) -> OpenAI:
    return OpenAI(base_url=pg_server.base_url + "/v1", api_key=api_key, max_retries=0)


@pytest.fixture
def model_id(pg_server) -> str:
    return pg_server.app.state.model.id

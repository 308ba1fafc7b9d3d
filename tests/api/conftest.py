from __future__ import annotations

import pytest

from batchapi.db.migrate import upgrade
from tests.utils.batch_service import live_server, service_settings


@pytest.fixture(scope="session")
def sqlite_server(tmp_path_factory, tiny_llama_dir):
    """The live server on SQLite and a local directory, no worker (``pg_server``'s twin)."""
    settings = service_settings(tmp_path_factory.mktemp("api-sqlite"), tiny_llama_dir)
    upgrade(settings)
    with live_server(settings) as server:
        yield server

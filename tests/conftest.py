"""Session-wide real services and models for the tests (no mocks, see tests/utils)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from openai import OpenAI

from batchapi.config import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL
from batchapi.context import open_context
from batchapi.db.migrate import upgrade
from tests.utils import services
from tests.utils.batch_service import new_key, pg_live_server, service_settings
from tests.utils.tiny_models import build_thinking_model, build_tiny_model

MODEL_CACHE = Path(os.environ.get("BATCHAPI_MODEL_CACHE", "~/.cache/batchapi")).expanduser()


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return MODEL_CACHE


@pytest.fixture(scope="session")
def smollm2_dir(model_cache: Path) -> Path:
    """The real default model, converted once into the shared cache (`make install` pulls it)."""
    from batchapi.models.store import pull_model

    return pull_model(DEFAULT_MODEL, model_cache)


@pytest.fixture(scope="session")
def minilm_dir(model_cache: Path) -> Path:
    """The default embedding model (all-MiniLM-L6-v2), unpacked once into the shared cache."""
    from batchapi.models.store import pull_model

    return pull_model(DEFAULT_EMBEDDING_MODEL, model_cache)


def _tiny_model_fixture(arch: str):
    """A session fixture: a tiny random ``arch`` model (tests/utils/tiny_models.py) with SmolLM2's tokenizer."""

    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory, smollm2_dir: Path) -> Path:
        name = "tiny-" + arch.replace("_", "-")
        return build_tiny_model(tmp_path_factory.mktemp("models") / name, smollm2_dir, arch)

    return fixture


tiny_llama_dir = _tiny_model_fixture("llama")
tiny_qwen2_dir = _tiny_model_fixture("qwen2")
tiny_qwen3_dir = _tiny_model_fixture("qwen3")
tiny_qwen3_moe_dir = _tiny_model_fixture("qwen3_moe")
tiny_gemma2_dir = _tiny_model_fixture("gemma2")
tiny_gemma3_dir = _tiny_model_fixture("gemma3")
tiny_mixtral_dir = _tiny_model_fixture("mixtral")


@pytest.fixture(scope="session")
def tiny_thinking_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """A tiny random Qwen3 model whose chat template thinks (tests/utils/tiny_models.py)."""
    return build_thinking_model(tmp_path_factory.mktemp("models") / "tiny-thinking", smollm2_dir)


@pytest.fixture(scope="session")
def pg_url() -> str:
    """A fresh, empty PostgreSQL database for this test session (plain postgresql:// URL)."""
    with services.fresh_database() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> str:
    services.ensure_redis()
    return f"redis://{services.REDIS_HOST}:{services.REDIS_PORT}/0"


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> services.S3Server:
    """A SeaweedFS S3 server (weed mini) on free ports, with credentials and a bucket."""
    with services.seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


# the service's context on PostgreSQL + S3, or on SQLite + a local directory
@pytest.fixture(scope="session")
def pg_settings(tmp_path_factory, pg_url, s3, tiny_llama_dir):
    settings = service_settings(tmp_path_factory.mktemp("ctx-pg"), tiny_llama_dir, pg_url=pg_url, s3=s3)
    upgrade(settings)
    return settings


@pytest.fixture
def pg_jobs(pg_settings):
    ctx = open_context(pg_settings)
    yield ctx
    ctx.close()


@pytest.fixture
def sqlite_jobs(tmp_path, tiny_llama_dir):
    settings = service_settings(tmp_path, tiny_llama_dir)
    upgrade(settings)
    ctx = open_context(settings)
    yield ctx
    ctx.close()


@pytest.fixture(params=["postgresql", "sqlite"])
def any_jobs(request):
    return request.getfixturevalue("pg_jobs" if request.param == "postgresql" else "sqlite_jobs")


# the live server the API tests (tests/api) and the SDK tests (tests/e2e) share
@pytest.fixture(scope="session")
def pg_server(tmp_path_factory, s3, tiny_llama_dir):
    """One live server on PostgreSQL (a database of its own) and SeaweedFS, no worker; tests stay
    apart by project."""
    with pg_live_server(tmp_path_factory.mktemp("api-pg"), tiny_llama_dir, s3) as server:
        yield server


@pytest.fixture
def api_key(pg_server, request) -> str:
    return new_key(pg_server, f"project-{request.node.name}")


@pytest.fixture
def client(pg_server, api_key) -> OpenAI:
    return OpenAI(base_url=pg_server.base_url + "/v1", api_key=api_key, max_retries=0)


@pytest.fixture
def model_id(pg_server) -> str:
    return pg_server.app.state.model.id


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """A test that runs ``batchapi.cli.main`` in-process configures the root logger for a process
    (batchapi.logs); put it back afterwards, so later tests log as pytest set them up."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)

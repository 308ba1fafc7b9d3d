from __future__ import annotations

import pytest

from batchapi.jobs.context import open_jobs
from batchapi.jobs.migrate import upgrade
from tests.utils.batch_service import service_settings


@pytest.fixture(scope="session")
def pg_settings(tmp_path_factory, pg_url, s3, tiny_llama_dir):
    settings = service_settings(tmp_path_factory.mktemp("jobs-pg"), tiny_llama_dir, pg_url=pg_url, s3=s3)
    upgrade(settings)
    return settings


@pytest.fixture
def pg_jobs(pg_settings):
    jobs = open_jobs(pg_settings)
    yield jobs
    jobs.close()


@pytest.fixture
def sqlite_jobs(tmp_path, tiny_llama_dir):
    settings = service_settings(tmp_path, tiny_llama_dir)
    upgrade(settings)
    jobs = open_jobs(settings)
    yield jobs
    jobs.close()


@pytest.fixture(params=["postgresql", "sqlite"])
def any_jobs(request):
    return request.getfixturevalue("pg_jobs" if request.param == "postgresql" else "sqlite_jobs")

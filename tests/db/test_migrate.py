"""The Alembic history builds exactly the models' schema, and unbuilds it."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from batchapi.config import load_settings
from batchapi.db.migrate import current, downgrade, upgrade
from batchapi.db.models import Base
from tests.utils import services

HEAD = "0011"
TABLES = {"projects", "api_keys", "files", "batches", "shards", "alembic_version"}
TABLES |= {"request_results"}  # 0004
TABLES |= {"webhook_endpoints", "webhook_deliveries", "uploads", "upload_parts"}  # 0005
TABLES |= {"dashboard_sessions"}  # 0006
TABLES |= {"result_cache"}  # 0009
TABLES |= {"quotas"}  # 0010


def round_trip(settings) -> None:
    upgrade(settings)
    assert current(settings) == HEAD
    engine = create_engine(settings.sqlalchemy_url)
    try:
        assert set(inspect(engine).get_table_names()) == TABLES
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == []
        downgrade(settings, "base")
        assert current(settings) is None
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        upgrade(settings)  # and up again from base
        assert current(settings) == HEAD
    finally:
        engine.dispose()


def test_postgres_upgrade_from_empty_to_head_and_down():
    with services.fresh_database("batchapi_migrate") as url:
        round_trip(load_settings(database_url=url))


def test_sqlite_upgrade_and_down(tmp_path):
    round_trip(load_settings(data_dir=tmp_path / "data"))
    assert (tmp_path / "data" / "batchapi.db").is_file()

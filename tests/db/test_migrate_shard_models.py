"""0008: the shards made before it take their batch's model, on PostgreSQL and SQLite; down again
drops the columns and keeps the rows."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect, text

from batchapi.config import load_settings
from batchapi.db.migrate import current, downgrade, upgrade
from tests.utils import services

ROWS = [
    "INSERT INTO projects (id, name, created_at) VALUES ('proj_1', 'p', 1)",
    *(f"INSERT INTO batches (id, project_id, endpoint, model, input_file_id, completion_window, status, created_at, "
      f"expires_at, request_total, request_completed, request_failed, input_tokens, cached_tokens, output_tokens, "
      f"estimated_input_tokens, estimated_output_tokens, currency, price_input, price_cached_input, price_output, "
      f"discount_percent) VALUES ('{bid}', 'proj_1', '/v1/messages', {model}, 'file-1', '24h', 'in_progress', 1, 2, "
      f"2, 0, 0, 0, 0, 0, 0, 0, 'usd', 1, 1, 1, 50)"
      for bid, model in (("batch_a", "'model-a'"), ("batch_v", "NULL"))),
    *(f"INSERT INTO shards (id, batch_id, index, first_line, last_line, start_byte, end_byte, request_count, "
      f"prompt_tokens, estimated_output_tokens, tokens_counted, status, attempts, completed_count, failed_count, "
      f"input_tokens, cached_tokens, output_tokens, created_at) VALUES ('{sid}', '{bid}', {i}, 1, 1, 0, 10, 1, 0, 0, "
      f"false, 'queued', 0, 0, 0, 0, 0, 0, 1)"
      for sid, bid, i in (("batch_a_00000", "batch_a", 0), ("batch_a_00001", "batch_a", 1),
                          ("batch_v_00000", "batch_v", 0))),
]


def shard_models_filled(settings) -> None:
    upgrade(settings, "0007")
    engine = create_engine(settings.sqlalchemy_url)
    try:
        with engine.begin() as conn:
            for statement in ROWS:
                conn.execute(text(statement.replace(" index,", ' "index",')))
        upgrade(settings, "0008")
        assert current(settings) == "0008"
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT id, model, lines FROM shards ORDER BY id")).all()
            per_model = conn.execute(text("SELECT per_model FROM batches ORDER BY id")).scalars().all()
        assert [tuple(r) for r in rows] == [("batch_a_00000", "model-a", None), ("batch_a_00001", "model-a", None),
                                            ("batch_v_00000", None, None)]
        assert per_model == [None, None]
        downgrade(settings, "0007")
        assert "model" not in {c["name"] for c in inspect(engine).get_columns("shards")}
        assert "per_model" not in {c["name"] for c in inspect(engine).get_columns("batches")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM shards")).scalar() == 3
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_existing_shards_take_their_batchs_model(backend, tmp_path):
    if backend == "sqlite":
        shard_models_filled(load_settings(data_dir=tmp_path / "data"))
        return
    with services.fresh_database("batchapi_migrate_0008") as url:
        shard_models_filled(load_settings(database_url=url))

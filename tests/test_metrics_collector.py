"""The job tables' collector on a fresh PostgreSQL database: each metric from rows whose numbers
the test chose (outcomes of cancelled and expired batches, queued shards, lease recoveries,
webhook deliveries)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from batchapi import metrics
from batchapi.config import load_settings
from batchapi.db.clock import now
from batchapi.db.migrate import upgrade
from batchapi.db.models import Batch, Project, Shard, WebhookDelivery, WebhookEndpoint
from batchapi.db.session import make_engine, make_sessionmaker, session_scope
from tests.utils import services


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    with services.fresh_database("batchapi_metrics") as url:
        settings = load_settings(database_url=url, data_dir=tmp_path_factory.mktemp("metrics"))
        upgrade(settings)
        engine = make_engine(settings)
        yield make_sessionmaker(engine)
        engine.dispose()


def batch(bid: str, status: str, model: str | None, **counts) -> Batch:
    t = now()
    return Batch(id=bid, project_id="proj_m", endpoint="/v1/chat/completions", model=model, input_file_id="file-m",
                 completion_window="24h", status=status, created_at=t, expires_at=t + 60,
                 price_input=Decimal(1), price_cached_input=Decimal(1), price_output=Decimal(1),
                 discount_percent=Decimal(50), **counts)


def shard(bid: str, index: int, status: str, requests: int, attempts: int) -> Shard:
    return Shard(id=f"{bid}_{index:05d}", batch_id=bid, index=index, first_line=1, last_line=requests, start_byte=0,
                 end_byte=0, request_count=requests, status=status, attempts=attempts, created_at=now())


def delivery(did: str, status: str, attempts: int) -> WebhookDelivery:
    return WebhookDelivery(id=did, event_id=f"evt_{did}", endpoint_id="we_m", project_id="proj_m", batch_id="batch_m1",
                           event_type="batch.completed", payload="{}", status=status, attempts=attempts,
                           next_attempt_at=0, created_at=now())


def test_each_metric_from_the_rows(sessions):
    with session_scope(sessions) as session:
        session.add(Project(id="proj_m", name="metrics", created_at=now()))
        session.add(WebhookEndpoint(id="we_m", project_id="proj_m", name="hook", url="http://127.0.0.1:9/",
                                    event_types=["batch.completed"], secret="whsec_x", created_at=0, updated_at=0))
        session.flush()
        session.add_all([
            batch("batch_m1", "completed", "m-a", request_total=5, request_completed=4, request_failed=1,
                  input_tokens=100, cached_tokens=16, output_tokens=40),
            batch("batch_m2", "cancelled", "m-a", request_total=6, request_completed=1, request_failed=5,
                  request_unrun=3, input_tokens=10, output_tokens=2),
            batch("batch_m3", "expired", "m-b", request_total=4, request_completed=0, request_failed=4, request_unrun=4),
            batch("batch_m4", "in_progress", "m-b", request_total=9),
            batch("batch_m5", "validating", None),
        ])
        session.flush()
        session.add_all([shard("batch_m4", 0, "queued", 4, 0), shard("batch_m4", 1, "queued", 3, 2),
                         shard("batch_m4", 2, "running", 2, 3), shard("batch_m1", 0, "succeeded", 5, 1)])
        session.add_all([delivery("d1", "delivered", 1), delivery("d2", "delivered", 3), delivery("d3", "failed", 7),
                         delivery("d4", "pending", 0)])

    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in metrics.DatabaseCollector(sessions).collect() for s in family.samples}
    assert {labels[0][1]: v for (name, labels), v in got.items() if name == "batchapi_batches"} == {
        "completed": 1, "cancelled": 1, "expired": 1, "in_progress": 1, "validating": 1}
    assert {labels[0][1]: v for (name, labels), v in got.items() if name == "batchapi_requests_finished_total"} == {
        "succeeded": 5, "errored": 3, "canceled": 3, "expired": 4}
    assert got[("batchapi_input_tokens_total", (("model", "m-a"),))] == 110
    assert got[("batchapi_cached_input_tokens_total", (("model", "m-a"),))] == 16
    assert got[("batchapi_output_tokens_total", (("model", "m-a"),))] == 42
    assert got[("batchapi_model_requests_total", (("model", "m-b"),))] == 0
    assert got[("batchapi_shards", (("model", "m-b"), ("status", "queued")))] == 2
    assert got[("batchapi_shards", (("model", "m-b"), ("status", "running")))] == 1
    assert got[("batchapi_queued_requests", (("model", "m-b"),))] == 7
    assert got[("batchapi_shard_lease_recoveries_total", ())] == 1 + 2
    assert got[("batchapi_webhook_deliveries", (("status", "delivered"),))] == 2
    assert got[("batchapi_webhook_deliveries", (("status", "failed"),))] == 1
    assert got[("batchapi_webhook_delivery_attempts_total", (("status", "delivered"),))] == 4
    assert got[("batchapi_webhook_failed_sends_total", ())] == (4 - 2) + 7

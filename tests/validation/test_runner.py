"""Validation against the database: outcomes, shard rows, dispatch after commit, resuming."""

from __future__ import annotations

import dataclasses
import io
from decimal import Decimal

import pytest
from sqlalchemy import select, update

from batchapi.batches import states
from batchapi.batches.billing import cost, estimated_cost
from batchapi.batches.files import delete_file, upload_file
from batchapi.batches.leases import claim_validation
from batchapi.batches.service import create_batch, get_batch
from batchapi.batches.states import BatchStatus
from batchapi.batches.sweeper import sweep
from batchapi.db.models import Batch, File, Shard
from batchapi.db.projects import get_or_create_project
from batchapi.db.session import session_scope
from batchapi.models.registry import served_model
from batchapi.storage.streams import TooLarge
from batchapi.validation.backfill import count_batch
from batchapi.validation.runner import resume, validate_batch
from batchapi.validation.token_counts import counter_for
from tests.utils.batch_service import jsonl, request_line

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


class RecordingDispatcher:
    def __init__(self, ctx):
        self.ctx = ctx
        self.ready: list[tuple[str, list[str], int]] = []

    def batch_ready(self, batch_id, shard_ids, model=None):
        with self.ctx.sessions() as session:  # a fresh session sees only committed rows
            visible = len(session.scalars(select(Shard.id).where(Shard.batch_id == batch_id)).all())
        self.ready.append((batch_id, shard_ids, visible))

    def batch_cancelled(self, batch_id):
        pass


class InlineValidator:
    """The sweeper's ``Validator``, validating on the sweeping thread (the API's runs a pool)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.resumed: list[str] = []

    def resume(self, batch_id):
        if resume(self.ctx, batch_id):
            self.resumed.append(batch_id)

    def backfill(self):
        pass


def resume_stale(ctx) -> list[str]:
    validator = InlineValidator(ctx)
    sweep(ctx, validator, shards=False)
    return validator.resumed


@pytest.fixture
def project(pg_jobs, request):
    with session_scope(pg_jobs.sessions) as session:
        return get_or_create_project(session, f"runner-{request.node.name}").id


def new_batch(ctx, project, data: bytes) -> str:
    f = upload_file(ctx, project, "in.jsonl", "batch", io.BytesIO(data))
    return create_batch(ctx, project, f.id, CHAT, "24h").id


def model(ctx) -> str:
    from batchapi.models.registry import served_model_id

    return served_model_id(ctx.settings)


def test_valid_batch_gets_shards_then_dispatch(pg_jobs, project):
    pg_jobs.dispatcher = RecordingDispatcher(pg_jobs)
    bid = new_batch(pg_jobs, project, jsonl([request_line(f"r{i}", model(pg_jobs), max_tokens=7) for i in range(9)]))
    assert validate_batch(pg_jobs, bid) == BatchStatus.IN_PROGRESS
    assert pg_jobs.dispatcher.ready == [(bid, [f"{bid}_00000", f"{bid}_00001", f"{bid}_00002"], 3)]
    batch = get_batch(pg_jobs, project, bid)
    assert (batch.request_total, batch.estimated_output_tokens) == (9, 63)
    assert batch.validation_lease_expires_at is None
    assert estimated_cost(batch).amount > 0
    assert validate_batch(pg_jobs, bid) == BatchStatus.IN_PROGRESS  # a second run changes nothing
    assert len(pg_jobs.dispatcher.ready) == 1

    bound = batch.estimated_input_tokens
    assert count_batch(pg_jobs, bid) == 3
    assert count_batch(pg_jobs, bid) == 0  # counted once
    counter = counter_for(served_model(pg_jobs.settings).path)
    text = counter.render_chat(request_line("r0", model(pg_jobs))["body"]["messages"])
    one = counter.count_texts([text], add_special_tokens=False)[0]
    with pg_jobs.sessions() as session:
        shards = session.scalars(select(Shard).where(Shard.batch_id == bid).order_by(Shard.index)).all()
    assert [s.prompt_token_counts for s in shards] == [[one] * 4, [one] * 4, [one]]
    assert all(s.tokens_counted and s.prompt_tokens == one * s.request_count for s in shards)
    batch = get_batch(pg_jobs, project, bid)
    assert batch.estimated_input_tokens == 9 * one < bound
    assert batch.estimated_output_tokens == 63


def test_interrupted_validation_is_resumed_once_its_lease_expires(pg_jobs, project):
    bid = new_batch(pg_jobs, project, jsonl([request_line("a", model(pg_jobs))]))
    assert not claim_validation(pg_jobs, bid, stale_only=True)  # the creator's lease still holds
    assert bid not in resume_stale(pg_jobs)
    with session_scope(pg_jobs.sessions) as session:  # the validator died long ago
        session.execute(update(Batch).where(Batch.id == bid).values(validation_lease_expires_at=1))
    assert bid in resume_stale(pg_jobs)
    assert get_batch(pg_jobs, project, bid).status == BatchStatus.IN_PROGRESS
    assert bid not in resume_stale(pg_jobs)


def test_only_one_claim_of_a_stale_batch_wins(pg_jobs, project):
    bid = new_batch(pg_jobs, project, jsonl([request_line("a", model(pg_jobs))]))
    with session_scope(pg_jobs.sessions) as session:
        session.execute(update(Batch).where(Batch.id == bid).values(validation_lease_expires_at=1))
    assert [claim_validation(pg_jobs, bid, stale_only=True) for _ in range(3)] == [True, False, False]


def test_file_over_the_size_limit_fails_without_reading(pg_jobs, project):
    small = dataclasses.replace(pg_jobs, settings=pg_jobs.settings.model_copy(update={"max_file_bytes": 100}))
    bid = new_batch(small, project, jsonl([request_line(f"r{i}", model(pg_jobs)) for i in range(3)]))
    assert validate_batch(small, bid) == BatchStatus.FAILED
    errors = get_batch(small, project, bid).errors["data"]
    assert [(e["code"], e["line"]) for e in errors] == [("file_too_large", None)]


def test_empty_file_fails(pg_jobs, project):
    bid = new_batch(pg_jobs, project, b"")
    assert validate_batch(pg_jobs, bid) == BatchStatus.FAILED
    assert get_batch(pg_jobs, project, bid).errors["data"][0]["code"] == "empty_file"


def test_deleted_input_file_fails(pg_jobs, project):
    bid = new_batch(pg_jobs, project, jsonl([request_line("a", model(pg_jobs))]))
    delete_file(pg_jobs, project, get_batch(pg_jobs, project, bid).input_file_id)
    assert validate_batch(pg_jobs, bid) == BatchStatus.FAILED
    assert get_batch(pg_jobs, project, bid).errors["data"][0]["code"] == "file_not_found"


def test_cancel_during_validation_ends_cancelled(pg_jobs, project):
    bid = new_batch(pg_jobs, project, jsonl([request_line("a", model(pg_jobs))]))
    with session_scope(pg_jobs.sessions) as session:
        assert states.transition(session, bid, BatchStatus.CANCELLING)
    assert validate_batch(pg_jobs, bid) == BatchStatus.CANCELLING  # it never started
    with session_scope(pg_jobs.sessions) as session:
        session.execute(update(Batch).where(Batch.id == bid).values(validation_lease_expires_at=1))
    resume_stale(pg_jobs)
    assert get_batch(pg_jobs, project, bid).status == BatchStatus.CANCELLED


def test_uploads_over_the_limit_are_refused_and_not_kept(pg_jobs, project):
    small = dataclasses.replace(pg_jobs, settings=pg_jobs.settings.model_copy(update={"max_upload_bytes": 10}))
    with pytest.raises(TooLarge):
        upload_file(small, project, "big.jsonl", "batch", io.BytesIO(b"x" * 11))
    with pg_jobs.sessions() as session:
        assert session.scalars(select(File).where(File.project_id == project)).all() == []


def test_cost_counts_only_recorded_usage_at_the_batch_discount(pg_jobs, project):
    bid = new_batch(pg_jobs, project, jsonl([request_line("a", model(pg_jobs))]))
    with session_scope(pg_jobs.sessions) as session:
        session.execute(update(Batch).where(Batch.id == bid).values(
            input_tokens=1500, cached_tokens=1024, output_tokens=500, price_input=Decimal("0.15"),
            price_cached_input=Decimal("0.075"), price_output=Decimal("0.60"), discount_percent=Decimal(50)))
    batch = get_batch(pg_jobs, project, bid)
    assert cost(batch).as_dict() == {"currency": "usd", "amount": "0.0002241", "list_amount": "0.0004482"}


def test_storage_outage_leaves_the_batch_for_a_retry(pg_jobs, project, s3):
    from batchapi.storage.s3 import S3Storage
    from batchapi.validation.runner import run_claimed

    bid = new_batch(pg_jobs, project, jsonl([request_line("a", model(pg_jobs))]))
    from tests.utils.services import free_port

    away = S3Storage(s3.bucket, "", f"http://127.0.0.1:{free_port()}", s3.region,  # nothing listens
                     s3.aws_access_key_id, s3.aws_secret_access_key)
    assert run_claimed(dataclasses.replace(pg_jobs, storage=away), bid) == BatchStatus.VALIDATING
    assert get_batch(pg_jobs, project, bid).status == BatchStatus.VALIDATING
    assert run_claimed(pg_jobs, bid) == BatchStatus.IN_PROGRESS  # storage is back


def test_a_body_problem_is_reported_early_and_the_batch_runs(pg_jobs, project):
    pg_jobs.dispatcher = RecordingDispatcher(pg_jobs)
    lines = [request_line(f"r{i}", model(pg_jobs), max_tokens=7) for i in range(6)]
    lines[4]["body"]["frobnicate"] = True
    bid = new_batch(pg_jobs, project, jsonl(lines))
    assert validate_batch(pg_jobs, bid) == BatchStatus.IN_PROGRESS
    batch = get_batch(pg_jobs, project, bid)
    assert batch.errors is None and batch.request_total == 6
    assert batch.request_errors == {"object": "list", "total": 1, "data": [{
        "code": "unknown_parameter", "message": "unrecognized request argument: 'frobnicate'",
        "param": "body.frobnicate", "line": 5}]}
    assert batch.estimated_output_tokens == 5 * 7  # the refused request generates nothing

    assert count_batch(pg_jobs, bid) == 2  # the exact counts keep one entry per request, 0 for the refused one
    counter = counter_for(served_model(pg_jobs.settings).path)
    one = counter.count_texts([counter.render_chat(lines[0]["body"]["messages"])], add_special_tokens=False)[0]
    with pg_jobs.sessions() as session:
        shards = session.scalars(select(Shard).where(Shard.batch_id == bid).order_by(Shard.index)).all()
    assert [s.prompt_token_counts for s in shards] == [[one] * 4, [0, one]]  # line 5 is refused
    assert [s.estimated_output_tokens for s in shards] == [28, 7]
    batch = get_batch(pg_jobs, project, bid)
    assert (batch.estimated_input_tokens, batch.estimated_output_tokens) == (5 * one, 35)


def test_a_file_of_refused_bodies_runs_and_a_resumed_validation_finds_them_again(pg_jobs, project):
    lines = [request_line(f"r{i}", model(pg_jobs), n=0) for i in range(3)]
    bid = new_batch(pg_jobs, project, jsonl(lines))
    with session_scope(pg_jobs.sessions) as session:  # the validator died long ago
        session.execute(update(Batch).where(Batch.id == bid).values(validation_lease_expires_at=1))
    assert bid in resume_stale(pg_jobs)
    batch = get_batch(pg_jobs, project, bid)
    assert batch.status == BatchStatus.IN_PROGRESS and batch.request_total == 3
    assert [(e["code"], e["line"]) for e in batch.request_errors["data"]] == [("invalid_value", i) for i in (1, 2, 3)]
    assert (batch.estimated_input_tokens, batch.estimated_output_tokens) == (0, 0)


def test_a_file_problem_still_fails_the_batch_with_its_line(pg_jobs, project):
    lines = [request_line("a", model(pg_jobs), temperature=9), "{oops", request_line("c", model(pg_jobs))]
    bid = new_batch(pg_jobs, project, jsonl(lines))
    assert validate_batch(pg_jobs, bid) == BatchStatus.FAILED
    batch = get_batch(pg_jobs, project, bid)
    assert [(e["code"], e["line"]) for e in batch.errors["data"]] == [("invalid_json_line", 2)]
    assert [(e["code"], e["line"], e["param"]) for e in batch.request_errors["data"]] == [
        ("invalid_value", 1, "body.temperature")]


def test_a_batch_without_body_problems_has_no_request_errors(pg_jobs, project):
    bid = new_batch(pg_jobs, project, jsonl([request_line("a", model(pg_jobs))]))
    assert validate_batch(pg_jobs, bid) == BatchStatus.IN_PROGRESS
    with pg_jobs.sessions() as session:  # SQL NULL, not a JSON null
        assert session.scalar(select(Batch.id).where(Batch.id == bid, Batch.request_errors.is_(None))) == bid


def test_a_message_batch_refuses_a_request_for_its_model_or_length_alone_and_counts_it_nothing(pg_jobs, project):
    pg_jobs.dispatcher = RecordingDispatcher(pg_jobs)
    served = model(pg_jobs)

    def line(i, name=served, text="Say hello.", max_tokens=7):
        return {"custom_id": f"m{i}", "method": "POST", "url": MESSAGES, "body": {
            "model": name, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}}

    lines = [line(0, "claude-x"), line(1), line(2, text="word " * 600), line(3), line(4, max_tokens=600)]
    f = upload_file(pg_jobs, project, "in.jsonl", "batch", io.BytesIO(jsonl(lines)))
    batch = create_batch(pg_jobs, project, f.id, MESSAGES, "24h")
    assert batch.model == served  # the first served model named, past a first request naming another
    assert validate_batch(pg_jobs, batch.id) == BatchStatus.IN_PROGRESS
    batch = get_batch(pg_jobs, project, batch.id)
    assert batch.errors is None and batch.request_total == 5
    assert [(e["line"], e["code"]) for e in batch.request_errors["data"]] == [
        (1, "model_not_found"), (3, "context_length_exceeded"), (5, "context_length_exceeded")]
    assert batch.estimated_output_tokens == 2 * 7

    count_batch(pg_jobs, batch.id)  # the exact counts give the refused requests nothing either
    counter = counter_for(served_model(pg_jobs.settings).path)
    one = counter.count_texts([counter.render_chat(lines[1]["body"]["messages"])], add_special_tokens=False)[0]
    with pg_jobs.sessions() as session:
        counts = [c for s in session.scalars(select(Shard).where(Shard.batch_id == batch.id).order_by(Shard.index))
                  for c in s.prompt_token_counts]
    assert counts == [0, one, 0, one, 0]
    batch = get_batch(pg_jobs, project, batch.id)
    assert (batch.estimated_input_tokens, batch.estimated_output_tokens) == (2 * one, 14)

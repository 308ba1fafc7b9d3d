"""Shards of one batch on several models (a Message Batch's): a worker claims only the shards of
the models it serves, and what each shard's requests used goes to its model's share of the
batch, priced at that model's price (on PostgreSQL and SQLite)."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import update

from batchapi.batches import leases, request_results
from batchapi.batches.billing import (
    PRICES,
    cost,
    discounted,
    estimated_cost,
    list_amount,
    model_parts,
    new_per_model,
)
from batchapi.batches.leases import Outcome
from batchapi.batches.request_results import Finished, Group
from batchapi.db.models import Batch, Shard
from batchapi.db.session import session_scope
from tests.utils.job_rows import make_batch

A, B = "smollm2-135m-instruct", "smollm2-360m-instruct"  # two models of the price table


def two_model_batch(ctx, models: list[str]) -> tuple[str, list[str]]:
    """A batch whose shards run on ``models`` (one shard each), as validation leaves a Message
    Batch of several models."""
    batch_id, shard_ids = make_batch(ctx, len(models))
    with session_scope(ctx.sessions) as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(
            model=models[0], per_model=new_per_model(ctx.settings, list(dict.fromkeys(models)))))
        for shard_id, model in zip(shard_ids, models, strict=True):
            session.execute(update(Shard).where(Shard.id == shard_id).values(model=model))
    return batch_id, shard_ids


def test_a_worker_of_one_model_never_takes_another_models_shard(any_jobs):
    ctx = any_jobs
    batch_id, (a0, b1, a2) = two_model_batch(ctx, [A, B, A])
    assert leases.claim(ctx, b1, "worker-a", [A]) is None
    taken = [leases.claim_next(ctx, "worker-a", [A]) for _ in range(3)]
    assert [(c.id, c.model) for c in taken[:2]] == [(a0, A), (a2, A)] and taken[2] is None
    assert leases.claim(ctx, a0, "worker-b", [B]) is None  # held already, and not B's anyway
    claimed = leases.claim_next(ctx, "worker-b", [B])
    assert (claimed.id, claimed.model) == (b1, B)
    assert leases.claim_next(ctx, "worker-b", [B]) is None
    assert leases.models_of(ctx, [a0, b1, a2]) == {A: [a0, a2], B: [b1]}


def finished(seq: int, tokens: int) -> Finished:
    return Finished(seq, True, b'{"custom_id": "x"}\n', input_tokens=tokens, cached_tokens=1, output_tokens=tokens)


def test_each_shards_usage_goes_to_its_models_share_and_price(any_jobs):
    ctx = any_jobs
    batch_id, (a0, b1) = two_model_batch(ctx, [A, B])
    on_a, on_b = leases.claim(ctx, a0, "worker-a", [A]), leases.claim(ctx, b1, "worker-b", [B])
    # a row written while the shard runs, then the rest at its completion
    assert request_results.record(ctx, [Group(a0, batch_id, 1, [finished(0, 10)], A)], "worker-a") == {a0}
    assert leases.complete(ctx, on_a, "worker-a", Outcome(2, 1, 30, 2, 30), "out-a", "err-a")
    assert leases.complete(ctx, on_b, "worker-b", Outcome(1, 0, 7, 1, 5), "out-b", "err-b")
    with ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
    share = {m: tuple(batch.per_model[m][f] for f in ("request_completed", "request_failed", "input_tokens",
                                                      "cached_tokens", "output_tokens")) for m in (A, B)}
    assert share == {A: (2, 1, 30, 2, 30), B: (1, 0, 7, 1, 5)}
    assert (batch.request_completed, batch.input_tokens, batch.output_tokens) == (3, 37, 35)
    expected = sum((discounted(list_amount(PRICES[m], *share[m][2:]), batch.discount_percent) for m in (A, B)),
                   Decimal(0))
    assert cost(batch).amount == expected != cost(model_parts(batch)[0]).amount
    assert [p.model for p in model_parts(batch)] == [A, B]
    assert estimated_cost(batch).amount == 0  # the estimates are validation's, none set here


def test_a_batch_of_one_model_keeps_its_own_columns(any_jobs):
    ctx = any_jobs
    batch_id, (a0,) = two_model_batch(ctx, [A])
    claimed = leases.claim(ctx, a0, "worker-a", [A])
    assert leases.complete(ctx, claimed, "worker-a", Outcome(1, 0, 4, 0, 2), "out", "err")
    with ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
    assert batch.per_model is None and model_parts(batch) == [batch]
    assert (batch.request_completed, batch.input_tokens, batch.output_tokens) == (1, 4, 2)

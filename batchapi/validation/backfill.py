"""Exact prompt token counts of a started batch, shard by shard, off the validation path.

Validation proves each prompt fits the context (tokenizing only prompts near the limit) and
starts the batch in seconds; this pass then tokenizes every prompt and records the counts on
the shard rows (``prompt_token_counts``) and the exact estimate on the batch. Each shard's
write is conditional on ``tokens_counted`` being false, so two counters never clash, and a
pass that dies is finished by the next sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import func, select, update

from batchapi.batches import states
from batchapi.batches.billing import set_estimates
from batchapi.batches.shard_input import shard_contents
from batchapi.batches.states import BatchStatus
from batchapi.context import Context
from batchapi.db.models import Batch, File, Shard
from batchapi.db.session import session_scope
from batchapi.errors import TRANSIENT
from batchapi.models.registry import served_model
from batchapi.openai.body import MESSAGES
from batchapi.openai.lines import parse_line
from batchapi.validation.token_counts import (
    PromptCounter,
    context_error,
    counter_for,
    exact_counts,
    more_prompt_counts,
    output_bound,
)

log = logging.getLogger(__name__)


def batches_to_count(ctx: Context) -> list[str]:
    with ctx.sessions() as session:
        query = (
            select(Shard.batch_id).join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.tokens_counted.is_(False), Batch.status.in_(sorted(states.ACTIVE)))
            .distinct()
        )
        return list(session.scalars(query))


def count_batch(
    ctx: Context, batch_id: str, counter: PromptCounter | None = None, stop: Callable[[], bool] = lambda: False
) -> int:
    """Count the prompts of every uncounted shard of ``batch_id``; returns shards counted.
    ``stop()`` is asked between shards, so a shutting-down process leaves the rest to a sweep."""
    with ctx.sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status not in states.ACTIVE:
            return 0
        file = session.get(File, batch.input_file_id)
        shards = list(session.scalars(
            select(Shard).where(Shard.batch_id == batch_id, Shard.tokens_counted.is_(False)).order_by(Shard.index)
        ))
    models: dict[str, tuple] = {}  # model -> (its counter, its names): a Message Batch's shards run on several
    done = 0
    for shard in shards:
        if stop() or not _still_wanted(ctx, batch_id):
            break
        model = shard.model or batch.model
        try:
            if model not in models:
                served = served_model(ctx.settings, model)
                given = counter if counter is not None and model == batch.model else None
                models[model] = (given or counter_for(served.path), served.aliases)
        except LookupError:  # not served here (any more): its requests fail as they run; nothing to count
            log.warning("shard %s runs on %r, which is not served here; its estimate stays an upper bound",
                        shard.id, model)
            models[model] = None
        try:
            if models[model] is None:
                counts, outputs = None, shard.estimated_output_tokens
            else:
                counts, outputs = count_shard(ctx, *models[model], batch.endpoint, file.storage_key, shard)
        except TRANSIENT:
            raise
        except Exception:  # it would fail on every sweep: keep validation's bounds, count the other shards
            log.exception("counting the prompts of shard %s failed; its estimate stays an upper bound", shard.id)
            counts, outputs = None, shard.estimated_output_tokens
        values = {"prompt_token_counts": counts, "prompt_tokens": sum(counts)} if counts is not None else {}
        with session_scope(ctx.sessions) as session:
            done += session.execute(
                update(Shard).where(Shard.id == shard.id, Shard.tokens_counted.is_(False)).values(
                    estimated_output_tokens=outputs, tokens_counted=True, **values,
                )
            ).rowcount
    _refresh_estimate(ctx, batch_id)
    return done


def _still_wanted(ctx: Context, batch_id: str) -> bool:
    with ctx.sessions() as session:
        status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
    return status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


def count_shard(ctx: Context, counter: PromptCounter, names: frozenset[str], endpoint: str, key: str,
                shard) -> tuple[list[int], int]:
    """The exact prompt counts of a shard (a ``Shard`` row, or validation's plan of one) and its
    max_tokens bound; a refused request counts 0 and generates nothing."""
    contents = shard_contents(ctx.storage, key, shard.start_byte, shard.end_byte, shard.first_line, shard.lines,
                              ctx.settings.max_line_bytes)
    lines = [parse_line(content, line, endpoint) for line, content in contents]
    assert len(lines) == shard.request_count, (
        f"the shard from line {shard.first_line}: {len(lines)} lines, {shard.request_count} expected")
    # a line whose body is refused (found by validation, or a rule or limit changed since) is a 400
    # when its shard runs: it keeps its place in the counts with 0 tokens and generates nothing
    counts = [0] * len(lines)
    good = [i for i, line in enumerate(lines) if line.error is None]
    for i, count in zip(good, exact_counts(counter, [lines[i].body for i in good]), strict=True):
        counts[i] = count + (sum(more_prompt_counts(counter, lines[i].body)) if lines[i].body.more_prompts else 0)
    context = counter.context_length
    if endpoint == MESSAGES:  # each request its own concern: one refused for its model or length runs as a 400
        refused = {i for i in good if lines[i].body.model not in names
                   or context_error(lines[i].body, counts[i], context)}
        for i in refused:
            counts[i] = 0
        good = [i for i in good if i not in refused]
    return counts, sum(output_bound(lines[i].body, counts[i], context) for i in good)


def _refresh_estimate(ctx: Context, batch_id: str) -> None:
    with session_scope(ctx.sessions) as session:
        rows = session.execute(
            select(Shard.model, func.sum(Shard.prompt_tokens), func.sum(Shard.estimated_output_tokens))
            .where(Shard.batch_id == batch_id).group_by(Shard.model)
        ).all()
        per_model = session.scalar(select(Batch.per_model).where(Batch.id == batch_id).with_for_update())
        values = {} if not per_model else {"per_model": set_estimates(
            per_model, {model: (int(prompt or 0), int(output or 0)) for model, prompt, output in rows})}
        session.execute(update(Batch).where(Batch.id == batch_id).values(
            estimated_input_tokens=sum(int(prompt or 0) for _, prompt, _ in rows),
            estimated_output_tokens=sum(int(output or 0) for _, _, output in rows), **values))

"""Per-request durability: a finished request's result line in the database within seconds.

A worker buffers the results its engine finishes and writes them in small groups
(``BATCHAPI_RESULT_FLUSH_ROWS`` or ``BATCHAPI_RESULT_FLUSH_SECONDS``, whichever comes first),
each group one transaction that checks the lease, inserts one ``request_results`` row per
request and adds them to their batch's ``request_counts`` and usage. So a result is counted once
and at once, and a worker whose lease was taken away writes nothing. Why rows, not objects: a
group is one multi-row INSERT and its counts one UPDATE in the same transaction, where objects
would need a second write to count them and a listing to find them again; the rows live only
while their shard runs (completing it moves them into its result objects and deletes them).

A shard taken over after a crash runs only the requests without a row (``stored``). A shard the
sweeper closes (cancelled, expired or out of attempts, its worker gone) keeps its rows: the
sweeper's error object names every request of the shard with the reason, in order, and
``shard_lines`` replaces the lines of the requests that have a row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from batchapi.batches.billing import add_usage
from batchapi.batches.sharing.spend_cap import stop_at_cap
from batchapi.batches.states import ShardStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch, RequestResult, Shard
from batchapi.db.session import session_scope
from batchapi.errors import NotFound
from batchapi.openai.lines import iter_lines


@dataclass(frozen=True)
class Finished:
    """One finished request: its result line and, when it succeeded, its usage."""

    seq: int  # its position in the shard
    succeeded: bool
    line: bytes  # newline included
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    # answered from the result cache (``result_cache``): charged nothing, so its usage above is 0;
    # the usage it had (input, cached, output tokens), which the batch shows as saved
    saved: tuple[int, int, int] | None = None
    reasoning_tokens: int = 0  # of its output tokens, those spent thinking


@dataclass(frozen=True)
class Counted:
    """What a shard's rows added to its batch's counts."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total(self) -> int:
        return self.completed + self.failed


def _counted(rows: list[Finished]) -> Counted:
    ok = [r for r in rows if r.succeeded]
    return Counted(len(ok), len(rows) - len(ok), sum(r.input_tokens for r in ok), sum(r.cached_tokens for r in ok),
                   sum(r.output_tokens for r in ok), sum(r.reasoning_tokens for r in ok))


@dataclass(frozen=True)
class Group:
    """The rows of one shard to write: ``shard_id`` of ``batch_id`` at ``attempt``, run on ``model``."""

    shard_id: str
    batch_id: str
    attempt: int
    rows: list[Finished]
    model: str | None = None


def record(ctx: Context, groups: list[Group], owner: str) -> set[str]:
    """Write each group's rows and add them to their batch's counts, all in one transaction, for
    the shards ``owner`` still holds (which extends their leases); returns those shards' ids."""
    t = now()
    written: set[str] = set()
    per_batch: dict[tuple[str, str | None], list[Finished]] = {}
    with session_scope(ctx.sessions) as session:
        for group in sorted(groups, key=lambda g: g.shard_id):  # one lock order for every writer
            if not group.rows:
                continue
            held = session.execute(
                update(Shard)
                # the attempt too: the same worker may hold a later attempt of the shard (its lease
                # ran out while the engine stalled, and it claimed the shard again)
                .where(Shard.id == group.shard_id, Shard.lease_owner == owner, Shard.status == ShardStatus.RUNNING,
                       Shard.attempts == group.attempt)
                .values(lease_expires_at=t + ctx.settings.lease_seconds)
                .execution_options(synchronize_session=False)
            ).rowcount
            if held != 1:
                continue
            inserted = set(session.scalars(
                _insert_new(session).values([
                    dict(shard_id=group.shard_id, seq=r.seq, succeeded=r.succeeded, line=r.line,
                         input_tokens=r.input_tokens, cached_tokens=r.cached_tokens, output_tokens=r.output_tokens,
                         reasoning_tokens=r.reasoning_tokens,
                         attempt=group.attempt)
                    for r in group.rows
                ]).on_conflict_do_nothing(index_elements=[RequestResult.shard_id, RequestResult.seq])
                .returning(RequestResult.seq)
            ))
            written.add(group.shard_id)
            # only rows new to the table count: a group written again (its commit's answer was lost
            # and the writer put it back) must not count its rows twice
            per_batch.setdefault((group.batch_id, group.model), []).extend(r for r in group.rows if r.seq in inserted)
        # the batch rows last, just before the commit: every writer of a batch's shards waits on its row
        for batch_id, model in sorted(per_batch, key=lambda key: (key[0], key[1] or "")):
            rows = per_batch[batch_id, model]
            add_counts(session, batch_id, _counted(rows), model=model,
                       saved=[r.saved for r in rows if r.saved is not None])
    return written


def _saved_values(saved: list[tuple[int, int, int]]) -> dict:
    """Requests answered from the result cache, and the usage they would have cost, as additions."""
    if not saved:
        return {}
    return dict(
        cached_requests=Batch.cached_requests + len(saved),
        cache_saved_input_tokens=Batch.cache_saved_input_tokens + sum(s[0] for s in saved),
        cache_saved_cached_tokens=Batch.cache_saved_cached_tokens + sum(s[1] for s in saved),
        cache_saved_output_tokens=Batch.cache_saved_output_tokens + sum(s[2] for s in saved),
    )


def _insert_new(session: Session):
    """INSERT ... ON CONFLICT DO NOTHING of the session's dialect (PostgreSQL or SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(RequestResult)
    return sqlite.insert(RequestResult)


def add_counts(session: Session, batch_id: str, c: Counted, unrun: int = 0, model: str | None = None,
               saved: list[tuple[int, int, int]] | None = None) -> None:
    """Add to the batch's counts and usage, and to ``model``'s share of a batch of several models
    (read back under the row lock this UPDATE took, so two writers never lose each other's).
    ``saved``: the usage of requests answered from the result cache (input, cached, output
    tokens each), counted apart. A batch with a ``max_cost`` that this reaches is stopped
    (``spend_cap``). One UPDATE of the batch's row: callers make it their transaction's last
    statement, since every writer of the batch's shards waits on that row until the commit."""
    row = session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(
            request_completed=Batch.request_completed + c.completed,
            request_failed=Batch.request_failed + c.failed,
            request_unrun=Batch.request_unrun + unrun,
            input_tokens=Batch.input_tokens + c.input_tokens,
            cached_tokens=Batch.cached_tokens + c.cached_tokens,
            output_tokens=Batch.output_tokens + c.output_tokens,
            reasoning_tokens=Batch.reasoning_tokens + c.reasoning_tokens,
            **_saved_values(saved or []),
        )
        .returning(Batch.per_model, Batch.max_cost)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is None:
        return
    per_model, max_cost = row
    if per_model and model in per_model:
        share = dict(request_completed=c.completed, request_failed=c.failed, input_tokens=c.input_tokens,
                     cached_tokens=c.cached_tokens, output_tokens=c.output_tokens)
        session.execute(update(Batch).where(Batch.id == batch_id).values(per_model=add_usage(per_model, model, share))
                        .execution_options(synchronize_session=False))
    if max_cost is not None and (c.input_tokens or c.output_tokens):
        stop_at_cap(session, batch_id)


def counted(session: Session, shard_id: str) -> Counted:
    """The sums of the shard's rows: what they added to the batch."""
    ok = RequestResult.succeeded.is_(True)
    row = session.execute(
        select(
            func.count().filter(ok), func.count().filter(~ok),
            *(func.coalesce(func.sum(c), 0) for c in
              (RequestResult.input_tokens, RequestResult.cached_tokens, RequestResult.output_tokens,
               RequestResult.reasoning_tokens)),
        ).where(RequestResult.shard_id == shard_id)
    ).one()
    return Counted(*(int(v) for v in row))


def stored_seqs(session: Session, shard_id: str) -> set[int]:
    """The seqs of the shard's rows."""
    return set(session.scalars(select(RequestResult.seq).where(RequestResult.shard_id == shard_id)))


def forget(session: Session, shard_id: str) -> None:
    """The shard's rows are in its result objects now."""
    session.execute(delete(RequestResult).where(RequestResult.shard_id == shard_id))


def _finished(row: RequestResult) -> Finished:
    return Finished(row.seq, row.succeeded, row.line, row.input_tokens, row.cached_tokens, row.output_tokens,
                    reasoning_tokens=row.reasoning_tokens)


def stored(ctx: Context, shard_id: str) -> dict[int, Finished]:
    """The shard's finished requests, by position."""
    with ctx.sessions() as session:
        rows = session.scalars(select(RequestResult).where(RequestResult.shard_id == shard_id))
        return {row.seq: _finished(row) for row in rows}


def shards_with_rows(session: Session, batch_id: str) -> set[str]:
    return set(session.scalars(
        select(RequestResult.shard_id).join(Shard, Shard.id == RequestResult.shard_id)
        .where(Shard.batch_id == batch_id).distinct()
    ))


def running_lines(rows: dict[int, Finished], succeeded: bool) -> Iterator[bytes]:
    """The result lines of a shard still running (its ``stored`` rows), in input order."""
    for seq in sorted(rows):
        if rows[seq].succeeded == succeeded:
            yield rows[seq].line


def shard_lines(ctx: Context, shard_id: str, key: str | None, succeeded: bool, has_rows: bool) -> Iterator[bytes]:
    """A done shard's output (``succeeded``) or error lines, in input order: its object at ``key``,
    merged with its rows when it has some (the sweeper closed it: its objects name every request
    as never run, and a row says how that request really ended)."""
    if not has_rows:
        if key:
            yield from ctx.storage.iter_chunks(key)
        return
    rows = stored(ctx, shard_id)
    if succeeded:  # the sweeper's output object is empty: the rows are the output
        if key:
            yield from ctx.storage.iter_chunks(key)
        yield from (rows[seq].line for seq in sorted(rows) if rows[seq].succeeded)
        return
    seen = 0
    for seen, content in enumerate(_object_lines(ctx, key), start=1):
        row = rows.get(seen - 1)
        if row is None:
            yield content
        elif not row.succeeded:
            yield row.line
    yield from (rows[seq].line for seq in sorted(rows) if seq >= seen and not rows[seq].succeeded)


def _object_lines(ctx: Context, key: str | None) -> Iterator[bytes]:
    if not key:
        return
    try:
        for _, _, _, content in iter_lines(ctx.storage.iter_chunks(key)):
            yield content + b"\n"
    except NotFound:
        return


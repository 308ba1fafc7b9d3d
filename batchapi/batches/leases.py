"""Leases: on shards (claim, heartbeat, release, complete) and on validations, each one
conditional UPDATE.

A shard is ``queued`` until a worker claims it (``running`` with ``lease_owner`` and
``lease_expires_at``); the owner heartbeats the lease while it works and completes the shard
when its result objects are in storage. Every write checks the owner, so a worker whose lease
was taken away (it stalled, the sweeper re-queued its shard) can change nothing any more: a
duplicated task message or a second worker finds no row to update and does no work twice.

A batch being validated holds a validation lease on its row (``validation_lease_expires_at``):
a validator that dies leaves it to run out, and the sweeper hands the batch to a live one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sqlalchemy import or_, select, update

from batchapi.batches import request_results, result_cache, states
from batchapi.batches.sharing import fair_share
from batchapi.batches.states import BatchStatus, ShardStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch, File, Shard
from batchapi.db.session import session_scope


@dataclass(frozen=True)
class Claimed:
    """What a worker needs to run a shard it holds the lease of."""

    id: str
    batch_id: str
    index: int
    first_line: int
    start_byte: int
    end_byte: int
    request_count: int
    attempts: int
    input_key: str
    endpoint: str
    expires_at: int
    model: str | None = None  # the shard's model: which of a worker's models runs it
    lines: tuple[int, ...] | None = None  # its requests' lines where the range holds other models' too
    # taken to be closed without running (``claim_for_closing``): its outcome names every request
    # as never run, and ``complete`` counts the ones with a stored result as they ended
    closing: bool = False


# the reasons that cut a shard short without the requests being at fault: theirs are "unrun"
CUT_OFF = frozenset({"batch_cancelled", "batch_expired"})


@dataclass(frozen=True)
class Outcome:
    """A finished shard: its counts and usage (usage counts succeeded requests only)."""

    completed: int
    failed: int
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reason: str | None = None  # batch_cancelled / batch_expired / shard_failed when cut short
    unrun: int = 0  # of the failed: never run because a cancel or expiry cut the shard short
    # seq -> the usage a request answered without running (a copy of another of the shard) had:
    # counted as saved where its row is not stored yet (a stored row counted it when written)
    saved: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    reasoning_tokens: int = 0  # of the output tokens, those spent thinking


def _runnable_batches(t: int):
    return select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS, Batch.expires_at > t)


def _of_models(query, models: list[str] | None):
    """Only shards of ``models`` (None: any), so a worker claims only what it can run."""
    return query if models is None else query.where(Shard.model.in_(models))


def claim(ctx: Context, shard_id: str, owner: str, models: list[str] | None = None) -> Claimed | None:
    """Claim ``shard_id`` if it is queued (and of one of ``models``) and its batch still runs; None
    when someone else has it, it is done, or its batch was cancelled or expired."""
    t = now()
    with session_scope(ctx.sessions) as session:
        result = session.execute(
            _of_models(update(Shard), models)
            .where(Shard.id == shard_id, Shard.status == ShardStatus.QUEUED,
                   Shard.batch_id.in_(_runnable_batches(t)))
            .values(_lease_values(ctx, owner, t))
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            return None
        return _load(session, shard_id)


CANDIDATES = 16  # batches a claim looks at, in the fair-share order, for a shard nobody has locked


def claim_next(ctx: Context, owner: str, models: list[str] | None = None,
               order=fair_share.claim_order) -> Claimed | None:
    """Claim the next queued shard of any running batch (of one of ``models``; None: any) by the
    fair-share rule between projects (``order``: ``fair_share.claim_order``): the first of the
    first batches in that order that has a queued shard no other claimer holds (``FOR UPDATE SKIP
    LOCKED`` on PostgreSQL, so workers polling together never wait on each other). The order is
    taken over batches, not shards: a queue of thousands of shards sorts only its batches."""
    t = now()
    for _ in range(3):  # a concurrent claimer may win every candidate between select and update
        with session_scope(ctx.sessions) as session:
            queued = _of_models(select(Shard.id), models).where(
                Shard.batch_id == Batch.id, Shard.status == ShardStatus.QUEUED)
            batches = session.scalars(
                order(select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS, Batch.expires_at > t,
                                             queued.exists()),
                      t, ctx.settings.fair_share_window_seconds)
                .limit(CANDIDATES)
            ).all()
            if not batches:
                return None
            for batch_id in batches:
                candidate = session.scalar(
                    _of_models(select(Shard.id), models)
                    .where(Shard.batch_id == batch_id, Shard.status == ShardStatus.QUEUED)
                    .order_by(Shard.index)
                    .limit(1)
                    .with_for_update(skip_locked=True)
                )
                if candidate is None:
                    continue
                result = session.execute(
                    update(Shard)
                    .where(Shard.id == candidate, Shard.status == ShardStatus.QUEUED)
                    .values(_lease_values(ctx, owner, t))
                    .execution_options(synchronize_session=False)
                )
                if result.rowcount == 1:
                    return _load(session, candidate)
                break  # SQLite: taken between the select and the update; look again
    return None


def claim_for_closing(ctx: Context, shard_id: str, owner: str) -> Claimed | None:
    """The sweeper takes a shard nobody is running (queued, or running on an expired lease)
    to close it without running it (cancelled, expired, or out of attempts)."""
    t = now()
    with session_scope(ctx.sessions) as session:
        result = session.execute(
            update(Shard)
            .where(
                Shard.id == shard_id,
                (Shard.status == ShardStatus.QUEUED) | ((Shard.status == ShardStatus.RUNNING) & (Shard.lease_expires_at < t)),
            )
            .values(lease_owner=owner, lease_expires_at=t + ctx.settings.lease_seconds, status=ShardStatus.RUNNING)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            return None
        return replace(_load(session, shard_id), closing=True)


def _lease_values(ctx: Context, owner: str, t: int) -> dict:
    return dict(
        status=ShardStatus.RUNNING, attempts=Shard.attempts + 1, lease_owner=owner,
        lease_expires_at=t + ctx.settings.lease_seconds, started_at=t,
    )


def _load(session, shard_id: str) -> Claimed:
    shard, batch, input_key = session.execute(
        select(Shard, Batch, File.storage_key)
        .join(Batch, Batch.id == Shard.batch_id)
        .join(File, File.id == Batch.input_file_id)
        .where(Shard.id == shard_id)
    ).one()
    return Claimed(
        id=shard.id, batch_id=shard.batch_id, index=shard.index, first_line=shard.first_line,
        start_byte=shard.start_byte, end_byte=shard.end_byte, request_count=shard.request_count,
        attempts=shard.attempts, input_key=input_key, endpoint=batch.endpoint, expires_at=batch.expires_at,
        model=shard.model or batch.model, lines=tuple(shard.lines) if shard.lines is not None else None,
    )


def models_of(ctx: Context, shard_ids: list[str]) -> dict[str | None, list[str]]:
    """The shards grouped by their model (to send each to its model's queue)."""
    out: dict[str | None, list[str]] = {}
    if not shard_ids:
        return out
    with ctx.sessions() as session:
        rows = session.execute(select(Shard.id, Shard.model).where(Shard.id.in_(shard_ids)).order_by(Shard.id))
        for sid, model in rows:
            out.setdefault(model, []).append(sid)
    return out


def heartbeat(ctx: Context, shard_ids: list[str], owner: str) -> set[str]:
    """Extend the leases ``owner`` still holds; returns the ids it holds."""
    if not shard_ids:
        return set()
    t = now()
    with session_scope(ctx.sessions) as session:
        session.execute(
            update(Shard)
            .where(Shard.id.in_(shard_ids), Shard.lease_owner == owner, Shard.status == ShardStatus.RUNNING)
            .values(lease_expires_at=t + ctx.settings.lease_seconds)
            .execution_options(synchronize_session=False)
        )
        held = session.scalars(
            select(Shard.id).where(Shard.id.in_(shard_ids), Shard.lease_owner == owner, Shard.status == ShardStatus.RUNNING)
        )
        return set(held)


def lost_leases():
    """A shard's claims that were lost rather than given back: what ``max_shard_attempts`` bounds."""
    return Shard.attempts - Shard.given_back


def release(ctx: Context, shard_ids: list[str], owner: str, *, lost: bool = False) -> int:
    """Give shards back to the queue; returns how many went back. The claim is given back (a
    worker shutting down, or that could not read the shard), not lost, unless ``lost``: the
    worker's engine died running it, which it may have caused, so it counts as a lost lease and a
    shard that kills every engine it meets ends as ``shard_failed``."""
    if not shard_ids:
        return 0
    with session_scope(ctx.sessions) as session:
        result = session.execute(
            update(Shard)
            .where(Shard.id.in_(shard_ids), Shard.lease_owner == owner, Shard.status == ShardStatus.RUNNING)
            .values(status=ShardStatus.QUEUED, lease_owner=None, lease_expires_at=None,
                    given_back=Shard.given_back + (0 if lost else 1))
            .execution_options(synchronize_session=False)
        )
        return result.rowcount


def complete(ctx: Context, claimed: Claimed, owner: str, outcome: Outcome, output_key: str, error_key: str,
             cache_entries: dict[str, result_cache.Entry] | None = None) -> bool:
    """Record a finished shard and add to the batch what its stored request results have not
    added yet, in one transaction, once: only the lease owner's UPDATE matches, so a shard is
    never counted twice. The worker's complete moves the stored results into the shard's objects
    (they are deleted); the sweeper's keeps them, merged into its lines by ``request_results``.
    ``cache_entries``: the shard's results for the result cache (``result_cache.store``)."""
    with session_scope(ctx.sessions) as session:
        held = session.scalar(
            select(Shard.id)
            .where(Shard.id == claimed.id, Shard.lease_owner == owner, Shard.status == ShardStatus.RUNNING,
                   Shard.attempts == claimed.attempts)  # not a later attempt of the same worker's
            .with_for_update()
        )
        if held is None:
            return False
        stored = request_results.counted(session, claimed.id)
        total = _with_stored(claimed, outcome, stored)
        status = ShardStatus.FAILED if total.reason else ShardStatus.SUCCEEDED
        result = session.execute(
            update(Shard)
            .where(Shard.id == claimed.id, Shard.lease_owner == owner, Shard.status == ShardStatus.RUNNING)
            .values(
                status=status, lease_expires_at=None, finished_at=now(), output_key=output_key,
                error_key=error_key, last_error=total.reason, completed_count=total.completed,
                failed_count=total.failed, unrun_count=total.unrun, input_tokens=total.input_tokens,
                cached_tokens=total.cached_tokens, output_tokens=total.output_tokens,
                reasoning_tokens=total.reasoning_tokens,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            return False
        rest = request_results.Counted(
            total.completed - stored.completed, total.failed - stored.failed,
            total.input_tokens - stored.input_tokens, total.cached_tokens - stored.cached_tokens,
            total.output_tokens - stored.output_tokens, total.reasoning_tokens - stored.reasoning_tokens,
        )
        if cache_entries:
            result_cache.store(session, ctx.settings, claimed.batch_id, cache_entries)
        written = request_results.stored_seqs(session, claimed.id) if outcome.saved else set()
        saved = [usage for seq, usage in outcome.saved.items() if seq not in written]
        if not claimed.closing:
            request_results.forget(session, claimed.id)
        # the batch's row last, just before the commit: the batch's other writers wait on it
        request_results.add_counts(session, claimed.batch_id, rest, unrun=total.unrun, model=claimed.model,
                                   saved=saved)
        return True


def _with_stored(claimed: Claimed, outcome: Outcome, stored: request_results.Counted) -> Outcome:
    """The shard's whole outcome: a worker's as it is (its render holds the stored results); the
    sweeper's with its stored requests counted as they ended rather than as never run."""
    if not claimed.closing:
        assert outcome.completed >= stored.completed and outcome.failed >= stored.failed, (
            f"the shard's results ({outcome}) miss some of its stored ones ({stored})"
        )
        return outcome
    never_run = max(outcome.failed - stored.total, 0)
    return Outcome(
        stored.completed, stored.failed + never_run, stored.input_tokens, stored.cached_tokens, stored.output_tokens,
        outcome.reason, never_run if outcome.reason in CUT_OFF else 0, reasoning_tokens=stored.reasoning_tokens,
    )


def requeue_expired(ctx: Context, shard_id: str) -> bool:
    """Put a shard whose owner stopped heartbeating back in the queue."""
    t = now()
    with session_scope(ctx.sessions) as session:
        result = session.execute(
            update(Shard)
            .where(Shard.id == shard_id, Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < t)
            .values(status=ShardStatus.QUEUED, lease_owner=None, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )
        return result.rowcount == 1


# ---- validation leases ----


def _validation_lease_expired(t: int):
    return or_(Batch.validation_lease_expires_at.is_(None), Batch.validation_lease_expires_at < t)


def claim_validation(ctx: Context, batch_id: str, *, stale_only: bool) -> bool:
    """Take the validation lease of ``batch_id``; with ``stale_only``, only an expired one."""
    t = now()
    query = update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
    if stale_only:
        query = query.where(_validation_lease_expired(t))
    with session_scope(ctx.sessions) as session:
        result = session.execute(query.values(validation_lease_expires_at=t + ctx.settings.validation_lease_seconds))
        return result.rowcount == 1


def renew_validation(ctx: Context, batch_id: str, **values) -> bool:
    """Extend the validation lease (and set ``values``); False when the batch left ``validating``."""
    with session_scope(ctx.sessions) as session:
        result = session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
            .values(validation_lease_expires_at=now() + ctx.settings.validation_lease_seconds, **values)
        )
        return result.rowcount == 1


def stale_validations(ctx: Context) -> tuple[list[str], list[str]]:
    """Batches whose validator died: those still ``validating``, and those cancelled meanwhile."""
    t = now()
    stale = _validation_lease_expired(t)
    with ctx.sessions() as session:
        validating = list(session.scalars(select(Batch.id).where(Batch.status == BatchStatus.VALIDATING, stale)))
        cancelling = list(session.scalars(
            select(Batch.id).where(Batch.status == BatchStatus.CANCELLING, Batch.in_progress_at.is_(None), stale)
        ))
    return validating, cancelling


def settle_cancelled_validation(ctx: Context, batch_id: str) -> str:
    """A batch cancelled while it was validating: nothing ran, so it is cancelled now. Returns
    the status it is in."""
    with session_scope(ctx.sessions) as session:
        states.transition(session, batch_id, BatchStatus.CANCELLED, validation_lease_expires_at=None)
        return session.scalar(select(Batch.status).where(Batch.id == batch_id)) or "missing"


# ---- a worker restarted under the same identity ----


def take_back(ctx: Context, identity: str, owner: str) -> tuple[int, int]:
    """A worker restarted as ``identity`` (``owner``, its new lease owner name, is
    ``IDENTITY/INCARNATION``) takes back, at once, the shards an earlier process of that identity
    held, rather than waiting for their leases to run out: they go back to the queue (its own
    feeder claims them next), except those whose leases were lost ``max_shard_attempts`` times, whose
    leases it ends now so that the sweeper closes them as it closes any shard that keeps losing
    its worker. An earlier process that still lives is fenced off as any worker that lost its
    lease is: its heartbeat, result writes and completion match no row. Returns (re-queued, ended)."""
    prefix = f"{identity}/"
    assert owner.startswith(prefix), f"{owner!r} is not an owner name of {identity!r}"
    earlier = (Shard.status == ShardStatus.RUNNING) & Shard.lease_owner.startswith(prefix, autoescape=True) & (
        Shard.lease_owner != owner)
    spent = lost_leases() >= ctx.settings.max_shard_attempts
    t = now()
    with session_scope(ctx.sessions) as session:
        requeued = session.execute(
            update(Shard).where(earlier, ~spent)
            .values(status=ShardStatus.QUEUED, lease_owner=None, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        ).rowcount
        ended = session.execute(
            update(Shard).where(earlier, spent)
            .values(lease_owner=owner, lease_expires_at=t - 1)
            .execution_options(synchronize_session=False)
        ).rowcount
    return requeued, ended

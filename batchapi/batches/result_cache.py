"""The result cache: a deterministic request answered again from an earlier batch's result.

Batch invariance makes a greedy (``temperature`` 0) or seeded request give the same tokens on
every run under the same ``system_fingerprint``, so a request whose ``key`` (a hash of the served
model, the fingerprint and the canonical parsed body) matches a succeeded request of an earlier
batch of the same project is answered with that request's response body, without running. Its
output line is that body under the new line's ``custom_id`` (the line's ``batch_req_`` and
``req_`` ids are fresh); the batch counts it as completed and cached (``cached_requests`` and the
usage it would have cost, ``cache_saved_*``) and charges nothing for it.

Entries are written when a shard completes, in its transaction (``store``), for the succeeded
requests its attempt ran; a worker looks a shard's keys up in one query (``lookup``) before it
hands the rest to the engine. An entry is served only while its batch's output file is live (not
deleted, not expired, its batch not deleted); the sweeper deletes the others (``remove_stale``).
A batch created with ``result_cache: false``, or a deployment with ``BATCHAPI_RESULT_CACHE=false``,
neither reads nor writes entries; a batch of several models (a Message Batch naming several) has
no cache, since its cost is kept per model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass

from sqlalchemy import and_, delete, exists, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch, File, ResultCacheEntry
from batchapi.db.session import session_scope
from batchapi.openai.body import ParsedBody


@dataclass(frozen=True)
class Entry:
    """A cached response body and the usage it had."""

    body: bytes
    input_tokens: int
    cached_tokens: int
    output_tokens: int


def deterministic(body: ParsedBody) -> bool:
    """Greedy or seeded: the same tokens on every run under the same fingerprint."""
    return body.temperature == 0 or body.seed is not None


def key(model: str, fingerprint: str | None, body: ParsedBody) -> str | None:
    """The cache key of a request, or None when its result may not be reused (sampled without a
    seed, or no fingerprint to tie it to an engine configuration)."""
    if not fingerprint or not deterministic(body):
        return None
    canonical = json.dumps({"model": model, "system_fingerprint": fingerprint, "body": body},
                           sort_keys=True, separators=(",", ":"), default=_fields)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _fields(value):
    """What ``json.dumps`` cannot write itself: a dataclass as the dict of its fields (the JSON
    ``dataclasses.asdict`` gives, without deep-copying every prompt first: a worker keys each
    request of a shard before it runs any), anything else as its ``repr``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return repr(value)


def _live(t: int):
    """The entry's batch is not deleted and its output file is live."""
    source = Batch.__table__.alias("source")
    return exists().where(
        source.c.id == ResultCacheEntry.batch_id, source.c.deleted_at.is_(None),
        File.id == source.c.output_file_id, File.deleted_at.is_(None),
        or_(File.expires_at.is_(None), File.expires_at > t),
    )


def enabled(ctx: Context, batch_id: str) -> bool:
    """Whether batch ``batch_id`` has the cache: on for the deployment and the batch, and of one
    model (a batch of several keeps its cost per model)."""
    if not ctx.settings.result_cache:
        return False
    with ctx.sessions() as session:
        return session.scalar(select(Batch.id).where(Batch.id == batch_id, Batch.result_cache.is_(True),
                                                     Batch.per_model.is_(None))) is not None


def lookup(ctx: Context, batch_id: str, keys: set[str]) -> dict[str, Entry]:
    """The entries for ``keys`` of batch ``batch_id``'s project, from other batches; none when the
    cache is off for the batch or the deployment. One indexed query."""
    if not keys or not ctx.settings.result_cache:
        return {}
    t = now()
    current = Batch.__table__.alias("current")
    with ctx.sessions() as session:
        rows = session.execute(
            select(ResultCacheEntry.key, ResultCacheEntry.body, ResultCacheEntry.input_tokens,
                   ResultCacheEntry.cached_tokens, ResultCacheEntry.output_tokens)
            .join(current, and_(current.c.id == batch_id, current.c.project_id == ResultCacheEntry.project_id))
            .where(current.c.result_cache.is_(True), current.c.per_model.is_(None),
                   ResultCacheEntry.key.in_(sorted(keys)), ResultCacheEntry.batch_id != batch_id, _live(t))
            .order_by(ResultCacheEntry.created_at.desc())
        ).all()
    found: dict[str, Entry] = {}
    for row in rows:
        found.setdefault(row.key, Entry(row.body, row.input_tokens, row.cached_tokens, row.output_tokens))
    return found


def store(session: Session, settings, batch_id: str, entries: dict[str, Entry]) -> int:
    """Add a completed shard's entries, in the transaction that completes it; returns how many."""
    if not entries or not settings.result_cache:
        return 0
    project = session.scalar(select(Batch.project_id).where(Batch.id == batch_id, Batch.result_cache.is_(True),
                                                            Batch.per_model.is_(None)))
    if project is None:
        return 0
    t = now()
    insert = (postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert)(
        ResultCacheEntry)
    session.execute(insert.values([
        dict(batch_id=batch_id, key=k, project_id=project, body=e.body, input_tokens=e.input_tokens,
             cached_tokens=e.cached_tokens, output_tokens=e.output_tokens, created_at=t)
        for k, e in sorted(entries.items())
    ]).on_conflict_do_nothing(index_elements=[ResultCacheEntry.batch_id, ResultCacheEntry.key]))
    return len(entries)


# the sweeper deletes stale entries every this many sweeps (a pass reads the whole table; the
# lookup never serves a stale entry meanwhile)
STALE_EVERY_SWEEPS = 10
_last_removal = {"at": float("-inf")}


def remove_stale_when_due(ctx: Context) -> int:
    """``remove_stale``, at most once every ``STALE_EVERY_SWEEPS`` sweep intervals in a process."""
    t = time.monotonic()
    if t - _last_removal["at"] < STALE_EVERY_SWEEPS * ctx.settings.sweep_seconds:
        return 0
    _last_removal["at"] = t
    return remove_stale(ctx)


def remove_stale(ctx: Context) -> int:
    """Delete the entries whose batch was deleted or whose output file is gone or expired (an
    entry of a batch still running, whose output file is not made yet, stays)."""
    made = select(Batch.id).where(or_(Batch.deleted_at.is_not(None), Batch.output_file_id.is_not(None)))
    with session_scope(ctx.sessions) as session:
        return session.execute(
            delete(ResultCacheEntry).where(ResultCacheEntry.batch_id.in_(made), ~_live(now()))
            .execution_options(synchronize_session=False)
        ).rowcount

"""Sharing the fleet between projects: the claim order, the fleet's rate, when each batch will finish.

**The claim order** (``claim_order``, of the batches ``leases.claim_next`` takes a shard from): a
batch at risk of missing its window first (earliest expiry first); then the project that was
given the least work for its weight; within a project, higher ``priority`` first, then the oldest
batch; within a batch, its first queued shard. The work a project
was given is the estimated tokens (prompt tokens and the max_tokens bound) of its shards claimed
in the last ``fair_share_window_seconds``, plus those still running: a virtual-time rule like
stride scheduling, computed from the shard rows themselves, so a claim writes only its own shard
row and workers never wait on a shared counter. A project that was idle comes back with a small
share used and goes first, but only by the work it did not use within the window.

**The fleet's rate** (``fleet_rate``): the estimated tokens of the shards finished in the window
over the time they took, in the same unit as the queue, so that the estimate's max_tokens bound
cancels out on a steady workload.

**The plan** (``plan``, a sweep step): the fluid version of the claim order. Batches at risk take
the whole fleet in order of expiry; the rest share it by project weight, each project working
through its batches in order. A batch whose planned finish is past its expiry is at risk from then
on (``deadline_risk_at``, logged), and every running batch gets its ``estimated_completion_at``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Float, case, cast, func, or_, select, update

from batchapi.batches.states import BatchStatus, ShardStatus
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.models import Batch, Project, Shard
from batchapi.db.session import session_scope

log = logging.getLogger(__name__)

NO_RISK = 2**62  # sorts after every expiry
ETA_STEP_SECONDS = 2  # a planned completion that moved less is not written again


def shard_work():
    """A shard's estimated tokens: the unit of fair share and of the fleet's rate."""
    return Shard.prompt_tokens + Shard.estimated_output_tokens


def _given(t: int, window: int):
    """Per project, the work of its shards claimed within the window or running now."""
    return (
        select(Batch.project_id.label("project_id"), func.sum(shard_work()).label("given"))
        .select_from(Shard)
        .join(Batch, Batch.id == Shard.batch_id)
        .where(or_(Shard.started_at >= t - window, Shard.status == ShardStatus.RUNNING))
        .group_by(Batch.project_id)
        .subquery("given")
    )


def claim_order(query, t: int, window: int):
    """``query`` (over batches) ordered by the fair-share rule."""
    given = _given(t, window)
    used = cast(func.coalesce(given.c.given, 0), Float) / Project.weight
    at_risk = case((Batch.deadline_risk_at.is_not(None), Batch.expires_at), else_=NO_RISK)
    return (
        query.join(Project, Project.id == Batch.project_id)
        .outerjoin(given, given.c.project_id == Batch.project_id)
        .order_by(at_risk, used, Batch.priority.desc(), Batch.created_at, Batch.id)
    )


def fifo_order(query, t: int, window: int):
    """The order before fair share, first come first served across projects: kept to measure the
    fair share against (bench/fairness.py)."""
    return query.order_by(Batch.created_at, Batch.id)


def fleet_rate(session, t: float, window: int) -> float | None:
    """Estimated tokens per second the fleet finished over the window; None before any finished.
    The rows hold whole seconds, rounded down: a shard started on average half a second after the
    second its row names."""
    work, started = session.execute(
        select(func.sum(shard_work()), func.min(Shard.started_at))
        .where(Shard.status == ShardStatus.SUCCEEDED, Shard.finished_at >= int(t) - window)
    ).one()
    if not work or started is None:
        return None
    return float(work) / max(t - max(started + 0.5, t - window), 1.0)


@dataclass(frozen=True)
class Queued:
    """What the plan knows of an unfinished batch."""

    id: str
    project_id: str
    remaining: float  # estimated tokens not done yet
    priority: int
    created_at: int
    expires_at: int
    at_risk: bool
    estimated_completion_at: int | None = None  # the last plan's


def finish_times(batches: Sequence[Queued], weights: dict[str, int], rate: float, t: float) -> dict[str, float]:
    """When each batch finishes if the fleet runs ``rate`` estimated tokens/s from ``t`` under the
    claim order, with every project's share as a fluid (generalised processor sharing)."""
    out: dict[str, float] = {}
    for b in sorted((b for b in batches if b.at_risk), key=lambda b: (b.expires_at, b.created_at, b.id)):
        t += b.remaining / rate
        out[b.id] = t
    queues: dict[str, list[list]] = {}
    for b in sorted((b for b in batches if not b.at_risk), key=lambda b: (-b.priority, b.created_at, b.id)):
        queues.setdefault(b.project_id, []).append([b.id, b.remaining])
    while queues:
        total = sum(weights.get(p, 1) for p in queues)
        share = {p: rate * weights.get(p, 1) / total for p in queues}
        step = min(q[0][1] / share[p] for p, q in queues.items())
        t += step
        for p in list(queues):
            head = queues[p][0]
            head[1] -= share[p] * step
            if head[1] <= 1e-6 * rate:
                out[head[0]] = t
                queues[p].pop(0)
                if not queues[p]:
                    del queues[p]
    return out


def remaining_work(batch: Batch) -> float:
    """The estimated tokens of a batch's requests that have not ended yet."""
    total = batch.estimated_input_tokens + batch.estimated_output_tokens
    if batch.request_total <= 0:
        return float(total)
    left = max(batch.request_total - batch.request_completed - batch.request_failed, 0)
    return total * left / batch.request_total


def queued(session, extra: Iterable[Queued] = ()) -> tuple[list[Queued], dict[str, int]]:
    """Every running batch as the plan sees it, with ``extra`` ones, and the projects' weights."""
    rows = session.scalars(select(Batch).where(Batch.status == BatchStatus.IN_PROGRESS)).all()
    batches = [
        Queued(b.id, b.project_id, remaining_work(b), b.priority, b.created_at, b.expires_at,
               b.deadline_risk_at is not None, b.estimated_completion_at)
        for b in rows
    ] + list(extra)
    weights = dict(session.execute(
        select(Project.id, Project.weight).where(Project.id.in_({b.project_id for b in batches}))
    ).all())
    return batches, weights


@dataclass(frozen=True)
class Plan:
    rate: float | None
    finish: dict[str, float]
    at_risk: list[str]  # batches found at risk by this plan


def plan(ctx: Context) -> Plan:
    """Find the batches that cannot meet their window, and set every running batch's estimated
    completion. Without a measured rate (nothing finished in the window) no batch has one."""
    t = time.time()
    window = ctx.settings.fair_share_window_seconds
    with session_scope(ctx.sessions) as session:
        rate = fleet_rate(session, t, window)
        if rate is None:
            session.execute(
                update(Batch)
                .where(Batch.status == BatchStatus.IN_PROGRESS, Batch.estimated_completion_at.is_not(None))
                .values(estimated_completion_at=None)
                .execution_options(synchronize_session=False)
            )
            return Plan(None, {}, [])
        batches, weights = queued(session)
        finish = finish_times(batches, weights, rate, t)
        late = [b for b in batches if not b.at_risk and finish[b.id] > b.expires_at]
        if late:
            late_ids = {b.id for b in late}
            batches = [Queued(**{**b.__dict__, "at_risk": True}) if b.id in late_ids else b for b in batches]
            finish = finish_times(batches, weights, rate, t)
            session.execute(
                update(Batch)
                .where(Batch.id.in_(late_ids), Batch.deadline_risk_at.is_(None))
                .values(deadline_risk_at=now())
                .execution_options(synchronize_session=False)
            )
            for b in late:
                log.warning("batch %s cannot finish by its expiry at the fleet's rate (%.0f estimated tokens/s); "
                            "it is served before other batches", b.id, rate)
        # only the estimates that moved: a batch's row is what its result writers queue on
        was = {b.id: b.estimated_completion_at for b in batches}
        moved = [{"id": bid, "estimated_completion_at": round(at)} for bid, at in sorted(finish.items())
                 if was[bid] is None or abs(round(at) - was[bid]) >= ETA_STEP_SECONDS]
        if moved:
            session.execute(update(Batch), moved, execution_options={"synchronize_session": False})
    return Plan(rate, finish, [b.id for b in late])

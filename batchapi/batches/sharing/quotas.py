"""Quotas: per project and model, a limit on enqueued tokens and one on unfinished batches.

A project's enqueued tokens for a model are the estimated tokens (prompt tokens and the max_tokens
bound, as validation found them) of its unfinished batches' requests of that model; its unfinished
batches are those that started and have not ended. Both are checked when a validated batch would
start (``refusal``): a batch over either limit fails instead, as OpenAI fails one over its
enqueued-token limit (``token_limit_exceeded``). The check and the start are one transaction that
holds the project's row lock, so two batches of one project starting at once cannot both slip
under a limit. A Message Batch is also refused at create (``check_create``, a 429 in Anthropic's
shape) while its project is already at a limit for a model it names.

The limits of a project and model: its ``quotas`` row for the model, else its row for every model
(``model`` empty), else the deployment's ``BATCHAPI_QUOTA_ENQUEUED_TOKENS`` and
``BATCHAPI_QUOTA_UNFINISHED_BATCHES``; 0 is no limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchapi.batches.billing import model_parts
from batchapi.batches.states import BatchStatus
from batchapi.config import Settings
from batchapi.db.models import Batch, Project, Quota
from batchapi.errors import RateLimited
from batchapi.openai.errors import ErrorCode

EVERY_MODEL = ""
UNFINISHED = (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)


@dataclass(frozen=True)
class Limits:
    enqueued_tokens: int  # 0: no limit
    unfinished_batches: int


@dataclass(frozen=True)
class Usage:
    enqueued_tokens: int = 0
    unfinished_batches: int = 0


def limits(session: Session, settings: Settings, project_id: str, model: str) -> Limits:
    rows = {q.model: q for q in session.scalars(
        select(Quota).where(Quota.project_id == project_id, Quota.model.in_([model, EVERY_MODEL])))}

    def pick(attr: str, default: int) -> int:
        for row in (rows.get(model), rows.get(EVERY_MODEL)):
            if row is not None and getattr(row, attr) is not None:
                return getattr(row, attr)
        return default

    return Limits(pick("enqueued_tokens", settings.quota_enqueued_tokens),
                  pick("unfinished_batches", settings.quota_unfinished_batches))


def usage(session: Session, project_id: str, exclude: str | None = None) -> dict[str, Usage]:
    """Per model, the project's enqueued tokens and unfinished batches (other than ``exclude``)."""
    out: dict[str, Usage] = {}
    batches = session.scalars(
        select(Batch).where(Batch.project_id == project_id, Batch.status.in_(UNFINISHED),
                            Batch.in_progress_at.is_not(None), Batch.id != (exclude or ""))
    )
    for batch in batches:
        for part in model_parts(batch):
            model = part.model or ""
            was = out.get(model, Usage())
            out[model] = Usage(was.enqueued_tokens + part.estimated_input_tokens + part.estimated_output_tokens,
                               was.unfinished_batches + 1)
    return out


def refusal(session: Session, settings: Settings, project_id: str, batch_id: str,
            estimates: dict[str, int], lock: bool = True) -> tuple[ErrorCode, str] | None:
    """Why a batch of ``estimates`` (model -> estimated tokens) may not start now, or None. With
    ``lock``, takes the project's row lock until the caller's transaction ends."""
    if lock:
        session.execute(select(Project.id).where(Project.id == project_id).with_for_update())
    now_used = usage(session, project_id, exclude=batch_id)
    for model, tokens in sorted(estimates.items()):
        limit, used = limits(session, settings, project_id, model), now_used.get(model, Usage())
        if limit.unfinished_batches and used.unfinished_batches + 1 > limit.unfinished_batches:
            return ErrorCode.BATCH_LIMIT_EXCEEDED, (
                f"Unfinished batch limit reached for {model} in this project. Limit: {limit.unfinished_batches} "
                f"unfinished batches. Please try again once some in_progress batches have been completed.")
        if limit.enqueued_tokens and used.enqueued_tokens + tokens > limit.enqueued_tokens:
            return ErrorCode.TOKEN_LIMIT_EXCEEDED, (
                f"Enqueued token limit reached for {model} in this project. Limit: {limit.enqueued_tokens:,} "
                f"enqueued tokens; enqueued now: {used.enqueued_tokens:,}; this batch: {tokens:,}. Please try "
                "again once some in_progress batches have been completed.")
    return None


def check_create(session: Session, settings: Settings, project_id: str, models: list[str]) -> None:
    """Refuse (429) a new batch of ``models`` while the project is at a limit for one of them."""
    now_used = usage(session, project_id)
    for model in models:
        limit, used = limits(session, settings, project_id, model), now_used.get(model, Usage())
        if limit.unfinished_batches and used.unfinished_batches >= limit.unfinished_batches:
            raise RateLimited(f"This project has {used.unfinished_batches} unfinished batches for {model}, its limit. "
                              "Please try again once some of them have ended.")
        if limit.enqueued_tokens and used.enqueued_tokens >= limit.enqueued_tokens:
            raise RateLimited(f"This project has {used.enqueued_tokens:,} enqueued tokens for {model}; its limit is "
                              f"{limit.enqueued_tokens:,}. Please try again once some batches have ended.")


def set_limits(session: Session, project_id: str, model: str, *, enqueued_tokens: int | None,
               unfinished_batches: int | None) -> Quota:
    """Set (None: leave as is) the project's limits for ``model`` (``EVERY_MODEL``: its default)."""
    row = session.get(Quota, (project_id, model))
    if row is None:
        row = Quota(project_id=project_id, model=model)
        session.add(row)
    if enqueued_tokens is not None:
        row.enqueued_tokens = enqueued_tokens
    if unfinished_batches is not None:
        row.unfinished_batches = unfinished_batches
    return row


@dataclass(frozen=True)
class ModelQuota:
    """One line of a project's quota overview (the CLI and the dashboard show it)."""

    model: str  # EVERY_MODEL: the project's default
    limits: Limits
    usage: Usage


def overview(session: Session, settings: Settings, project_id: str) -> list[ModelQuota]:
    """The project's limits and use for every model it has a limit row or unfinished work of, and
    its default (``EVERY_MODEL``) first."""
    used = usage(session, project_id)
    models = set(used) | set(session.scalars(select(Quota.model).where(Quota.project_id == project_id)))
    models.discard(EVERY_MODEL)
    return [ModelQuota(EVERY_MODEL, limits(session, settings, project_id, EVERY_MODEL),
                       Usage(sum(u.enqueued_tokens for u in used.values()),
                             sum(u.unfinished_batches for u in used.values())))] + [
        ModelQuota(m, limits(session, settings, project_id, m), used.get(m, Usage())) for m in sorted(models)]


def clear_limits(session: Session, project_id: str, model: str) -> bool:
    """Drop the project's own limits for ``model``: the deployment's apply again."""
    row = session.get(Quota, (project_id, model))
    if row is not None:
        session.delete(row)
    return row is not None

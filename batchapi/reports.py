"""Usage and costs over time, in the shapes of OpenAI's Usage API (``/v1/organization/usage/...``)
and Costs API (``/v1/organization/costs``).

A batch's usage and cost count once, whole, in the bucket of the moment the batch ended
(``completed_at``, else ``failed_at``, ``expired_at`` or ``cancelled_at``): only then are they
final, and only so does every report add up to the batches' own ``usage`` and ``cost`` to the
token and to the 1e-8 of the currency unit, since each batch's cost is the one ``billing.cost``
rounds once. A batch still running is in no report yet. ``num_model_requests`` counts succeeded
requests, the ones that carry usage (failed, cancelled and expired requests cost nothing).
A deleted Message Batch still counts: what it used was billed, so its row stays (``deleted_at``).
A Message Batch whose requests ran on several models counts as one part per model
(``billing.model_parts``), each priced and rounded on its own, adding up to the batch's cost.

Buckets are ``bucket_width`` long from ``start_time`` on (the last one ends at ``end_time``);
every bucket in range is listed, empty ones included, ``limit`` to a page.
"""

from __future__ import annotations

import base64
import binascii
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchapi.batches.billing import batch_price, cost, discounted, list_amount, model_parts
from batchapi.db.clock import now
from batchapi.db.models import Batch
from batchapi.errors import InvalidRequest

BUCKET_SECONDS = {"1m": 60, "1h": 3600, "1d": 86400}
# OpenAI's page sizes in buckets: (default, most)
USAGE_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
COSTS_LIMITS = {"1d": (7, 180)}
USAGE_GROUPS = {"project_id", "model", "batch"}
COSTS_GROUPS = {"project_id", "line_item"}
EMBEDDINGS = "/v1/embeddings"
ENDED_AT = func.coalesce(Batch.completed_at, Batch.failed_at, Batch.expired_at, Batch.cancelled_at)


@dataclass(frozen=True)
class Query:
    start_time: int
    end_time: int | None = None
    bucket_width: str = "1d"
    group_by: list[str] = field(default_factory=list)
    project_ids: list[str] | None = None
    models: list[str] | None = None
    batch: bool | None = None  # OpenAI's: true, batch jobs only; false, none of them; unset, all
    limit: int | None = None
    page: str | None = None


@dataclass(frozen=True)
class Window:
    """The buckets of one page: ``starts`` and the page's end; ``next_start`` if more follow."""

    starts: list[int]
    width: int
    end: int
    next_start: int | None

    def bucket_end(self, start: int) -> int:
        return min(start + self.width, self.end)


def usage_page(session: Session, query: Query, kind: str, visible: list[str] | None) -> dict:
    """``kind`` is ``completions`` (every endpoint but embeddings) or ``embeddings``; ``visible``
    the projects the key may see (None: all)."""
    _check_groups(query.group_by, USAGE_GROUPS)
    window = _window(query, USAGE_LIMITS)
    batches = [] if query.batch is False else _ended_batches(session, query, window, visible)
    by_bucket = _by_bucket([b for b in batches if (b.endpoint == EMBEDDINGS) == (kind == "embeddings")], window)
    buckets = []
    for start in window.starts:
        groups: dict[tuple, list[Batch]] = defaultdict(list)
        for b in by_bucket.get(start, ()):
            groups[_key(b, query.group_by)].append(b)
        results = [_usage_result(kind, key, group, query.group_by) for key, group in sorted(groups.items())]
        buckets.append(_bucket(start, window.bucket_end(start), results))
    return _page(buckets, window)


def costs_page(session: Session, query: Query, visible: list[str] | None) -> dict:
    _check_groups(query.group_by, COSTS_GROUPS)
    if query.bucket_width != "1d":
        raise InvalidRequest("bucket_width: the costs report has only 1d buckets.", "bucket_width")
    window = _window(query, COSTS_LIMITS)
    by_bucket = _by_bucket(_ended_batches(session, query, window, visible), window)
    by_project = "project_id" in query.group_by
    buckets = []
    for start in window.starts:
        amounts: dict[tuple, Decimal] = defaultdict(Decimal)
        for b in by_bucket.get(start, ()):
            items = line_items(b) if "line_item" in query.group_by else [(None, cost(b).amount)]
            for item, amount in items:
                amounts[(b.project_id if by_project else None, item, b.currency)] += amount
        results = [_cost_result(key, amount) for key, amount in sorted(amounts.items(), key=_sort_key)]
        buckets.append(_bucket(start, window.bucket_end(start), results))
    return _page(buckets, window)


def line_items(b: Batch) -> list[tuple[str, Decimal]]:
    """A batch's cost split into ``<model>, input`` / ``cached input`` / ``output`` lines that add
    up to ``billing.cost(b).amount`` exactly: each line is rounded as the whole is, and the
    rounding's remainder goes to the largest line."""
    price = batch_price(b)
    parts = [
        ("input", list_amount(price, b.input_tokens - b.cached_tokens, 0, 0)),
        ("cached input", list_amount(price, b.cached_tokens, b.cached_tokens, 0)),
        ("output", list_amount(price, 0, 0, b.output_tokens)),
    ]
    lines = [[f"{b.model}, {name}", discounted(amount, b.discount_percent)] for name, amount in parts]
    largest = max(lines, key=lambda line: line[1])
    largest[1] += cost(b).amount - sum(line[1] for line in lines)
    return [(name, amount) for name, amount in lines if amount or name is largest[0]]


# the query


def _check_groups(group_by: list[str], allowed: set[str]) -> None:
    unknown = [g for g in group_by if g not in allowed]
    if unknown:
        raise InvalidRequest(f"group_by: {unknown[0]!r} is not one of {sorted(allowed)}.", "group_by")


def _window(query: Query, limits: dict[str, tuple[int, int]]) -> Window:
    if query.bucket_width not in limits:
        raise InvalidRequest(f"bucket_width: must be one of {list(limits)}.", "bucket_width")
    width = BUCKET_SECONDS[query.bucket_width]
    end = query.end_time if query.end_time is not None else now() + 1
    if query.start_time < 0 or end <= query.start_time:
        raise InvalidRequest("end_time must be after start_time (Unix seconds).", "end_time")
    default, most = limits[query.bucket_width]
    limit = query.limit if query.limit is not None else default
    if not 1 <= limit <= most:
        raise InvalidRequest(f"limit: between 1 and {most} buckets for bucket_width {query.bucket_width}.", "limit")
    first = query.start_time if query.page is None else _page_start(query, width, end)
    starts = [first + i * width for i in range(min(limit, -(-(end - first) // width)))]
    after = starts[-1] + width
    return Window(starts, width, end, after if after < end else None)


def encode_page(start: int) -> str:
    return "page_" + base64.urlsafe_b64encode(f"bucket:{start}".encode()).decode().rstrip("=")


def _page_start(query: Query, width: int, end: int) -> int:
    token = query.page or ""
    try:
        raw = token.removeprefix("page_")
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
        start = int(text.removeprefix("bucket:")) if text.startswith("bucket:") else -1
    except (binascii.Error, UnicodeDecodeError, ValueError):
        start = -1
    if start < query.start_time or start >= end or (start - query.start_time) % width:
        raise InvalidRequest("page: not a next_page of this query.", "page")
    return start


def _ended_batches(session: Session, query: Query, window: Window, visible: list[str] | None) -> list[Batch]:
    projects = query.project_ids
    if visible is not None:
        projects = visible if projects is None else [p for p in projects if p in visible]
    first, last = window.starts[0], window.bucket_end(window.starts[-1])
    statement = select(Batch, ENDED_AT).where(ENDED_AT >= first, ENDED_AT < last, Batch.model.is_not(None))
    if projects is not None:
        statement = statement.where(Batch.project_id.in_(projects))
    if query.models:  # a batch of several models may hold one of them beside its first
        statement = statement.where(Batch.model.in_(query.models) | Batch.per_model.is_not(None))
    found = []
    for b, ended in session.execute(statement):
        for part in model_parts(b):  # the batch itself, or its share per model
            if query.models and part.model not in query.models:
                continue
            part.ended = ended  # a transient attribute: the bucket's key
            found.append(part)
    return found


def _by_bucket(batches: list[Batch], window: Window) -> dict[int, list[Batch]]:
    """Bucket start -> the batches that ended in it (all of them end inside the page)."""
    found: dict[int, list[Batch]] = defaultdict(list)
    for b in batches:
        found[window.starts[0] + (b.ended - window.starts[0]) // window.width * window.width].append(b)
    return found


# the shapes


def _key(b: Batch, group_by: list[str]) -> tuple:
    return tuple((name, _group_value(b, name)) for name in sorted(group_by))


def _group_value(b: Batch, name: str):
    return {"project_id": b.project_id, "model": b.model, "batch": True}[name]


def _usage_result(kind: str, key: tuple, group: list[Batch], group_by: list[str]) -> dict:
    values = dict(key)
    result = {
        "object": f"organization.usage.{kind}.result",
        "input_tokens": sum(b.input_tokens for b in group),
        "num_model_requests": sum(b.request_completed for b in group),
    }
    if kind == "completions":
        result.update(
            input_cached_tokens=sum(b.cached_tokens for b in group),
            output_tokens=sum(b.output_tokens for b in group),
            input_audio_tokens=0,
            output_audio_tokens=0,
        )
    names = ("project_id", "user_id", "api_key_id", "model") + (("batch",) if kind == "completions" else ())
    for name in names:
        result[name] = values.get(name) if name in group_by else None
    return result


def _sort_key(item: tuple) -> tuple:
    (project, line, currency), _ = item
    return (project or "", line or "", currency)


def _cost_result(key: tuple, amount: Decimal) -> dict:
    project, line, currency = key
    return {
        "object": "organization.costs.result",
        # a JSON number with the exact decimal digits: float's shortest repr of an amount of
        # 1e-8 steps under 1e7 gives those digits back
        "amount": {"value": float(amount), "currency": currency},
        "line_item": line,
        "project_id": project,
    }


def _bucket(start: int, end: int, results: list[dict]) -> dict:
    return {"object": "bucket", "start_time": start, "end_time": end, "results": results}


def _page(buckets: list[dict], window: Window) -> dict:
    more = window.next_start is not None
    return {"object": "page", "data": buckets, "has_more": more,
            "next_page": encode_page(window.next_start) if more else None}


def spend_by_model(session: Session, query: Query, visible: list[str] | None) -> dict[tuple[int, str], Decimal]:
    """Spend per (bucket start, model) over one page of ``query``'s buckets (the dashboard's chart)."""
    window = _window(query, USAGE_LIMITS)
    spend: dict[tuple[int, str], Decimal] = defaultdict(Decimal)
    for start, batches in _by_bucket(_ended_batches(session, query, window, visible), window).items():
        for b in batches:
            spend[(start, b.model)] += cost(b).amount
    return dict(spend)

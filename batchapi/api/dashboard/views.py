"""What the dashboard's pages show, computed from batch rows: progress, rates, ETA, daily usage."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from batchapi.api.schemas import BatchDiffObject, BatchObject
from batchapi.batches.billing import cost, format_amount
from batchapi.batches.diff.compare import BatchDiff
from batchapi.batches.sharing.quotas import ModelQuota
from batchapi.batches.states import TERMINAL, BatchStatus
from batchapi.db.models import Batch

DAY = 86400


@dataclass(frozen=True)
class Progress:
    batch_id: str
    status: str
    total: int
    completed: int
    failed: int
    percent: float
    tokens_per_second: float | None  # generated tokens per second since the batch started
    # the plan's (``fair_share``: the queue ahead at the fleet's rate), else at the batch's rate so
    # far; None when unknown or ended
    eta_seconds: int | None
    output_tokens: int
    cost: str
    currency: str
    active: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def progress(b: Batch, t: int) -> Progress:
    done = b.request_completed + b.request_failed
    total = b.request_total
    active = b.status not in TERMINAL
    end = _ended(b) or t
    # whole seconds: a batch that ran within one second counts as one
    elapsed = max(end - b.in_progress_at, 1) if b.in_progress_at else 0
    rate = b.output_tokens / elapsed if elapsed else None
    eta = None
    if b.status == BatchStatus.IN_PROGRESS and b.estimated_completion_at is not None:  # the fair share's plan
        eta = max(b.estimated_completion_at - t, 0)
    elif active and elapsed > 0 and 0 < done < total:
        eta = round((total - done) * elapsed / done)
    percent = 100.0 * done / total if total else (100.0 if not active else 0.0)
    bill = cost(b)
    return Progress(b.id, b.status, total, b.request_completed, b.request_failed, round(percent, 1),
                    round(rate, 1) if rate is not None else None, eta, b.output_tokens,
                    format_amount(bill.amount), bill.currency, active)


def _ended(b: Batch) -> int | None:
    return b.completed_at or b.failed_at or b.expired_at or b.cancelled_at


def batch_view(b: Batch, t: int) -> dict:
    return {"batch": BatchObject.of(b).model_dump(), "progress": progress(b, t),
            "unrun": b.request_unrun, "problems": problems(b)}


def comparable(b: Batch, others: list[Batch]) -> list[dict] | None:
    """The ended batches of ``b``'s endpoint it can be compared with (``/dashboard/batches/{id}/diff``);
    None while ``b`` itself runs."""
    if b.status not in TERMINAL:
        return None
    return [{"id": o.id, "status": o.status, "created_at": o.created_at} for o in others
            if o.id != b.id and o.status in TERMINAL and o.endpoint == b.endpoint]


def diff_view(found: BatchDiff) -> dict:
    """The diff as the API gives it (``GET /v1/batches/{id}/diff``)."""
    return BatchDiffObject.of(found).model_dump()


def problems(b: Batch) -> list[dict]:
    """The batch's file errors and the request bodies that validation refused, as listed rows."""
    rows = []
    for source, errors in (("file", b.errors), ("request", b.request_errors)):
        for item in (errors or {}).get("data", []) if isinstance(errors, dict) else []:
            rows.append({"source": source, "code": item.get("code"), "message": item.get("message"),
                         "line": item.get("line"), "param": item.get("param")})
    return rows


def limits_view(rows: list[ModelQuota]) -> list[dict]:
    """The project's quotas as the usage page lists them (0: no limit)."""
    return [{"model": q.model or "every model", "enqueued": q.usage.enqueued_tokens,
             "enqueued_limit": q.limits.enqueued_tokens, "batches": q.usage.unfinished_batches,
             "batches_limit": q.limits.unfinished_batches} for q in rows]


def day_label(start: int) -> str:
    return datetime.fromtimestamp(start, UTC).strftime("%m-%d")


def when(timestamp: int | None) -> str:
    return "" if not timestamp else datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: int | None) -> str:
    if seconds is None:
        return "–"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class DailyUsage:
    labels: list[str]
    models: list[str]
    tokens: dict[str, list[float]]  # model -> input + output tokens per day
    spend: dict[str, list[float]]  # model -> spend per day
    rows: list[dict]  # one per day and model, exact
    currency: str


def daily_usage(pages: list[dict], cost_by_day_model: dict[tuple[int, str], Decimal], currency: str) -> DailyUsage:
    """From a usage page per kind (group_by model, 1d buckets) and the spend per (day, model)."""
    starts = [bucket["start_time"] for bucket in pages[0]["data"]] if pages else []
    per: dict[tuple[int, str], dict] = defaultdict(lambda: {"input": 0, "cached": 0, "output": 0, "requests": 0})
    for page in pages:
        for bucket in page["data"]:
            for result in bucket["results"]:
                entry = per[(bucket["start_time"], result["model"])]
                entry["input"] += result["input_tokens"]
                entry["cached"] += result.get("input_cached_tokens", 0)
                entry["output"] += result.get("output_tokens", 0)
                entry["requests"] += result["num_model_requests"]
    models = sorted({model for _, model in per} | {model for _, model in cost_by_day_model})
    tokens = {m: [float(per[(s, m)]["input"] + per[(s, m)]["output"]) if (s, m) in per else 0.0 for s in starts]
              for m in models}
    spend = {m: [float(cost_by_day_model.get((s, m), 0)) for s in starts] for m in models}
    rows = [{"day": datetime.fromtimestamp(s, UTC).strftime("%Y-%m-%d"), "model": m, **per[(s, m)],
             "cost": format_amount(cost_by_day_model.get((s, m), Decimal(0)))}
            for s in starts for m in models if (s, m) in per or (s, m) in cost_by_day_model]
    return DailyUsage([day_label(s) for s in starts], models, tokens, spend, rows, currency)

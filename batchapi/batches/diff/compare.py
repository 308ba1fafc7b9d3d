"""The diff of two ended batches of a project, by ``custom_id``: ``batch`` is the earlier run,
``against`` the one compared with it; deltas are ``against`` less ``batch``.

Memory: one pass over ``batch``'s results keeps a digest and the counts of each (never the
lines), one pass over ``against``'s compares with it and keeps the results of the requests it
will list (at most ``limit`` of each kind); those get their ``batch`` results from one more
pass, which parses only their lines. The input files, when
they are still there, tell whether a request asked the same both times and whether its output is
fixed by the configuration (greedy, seeded, embeddings): a changed output of such a request under
the same ``system_fingerprint`` breaks reproducibility.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from batchapi.batches.diff.outcomes import Outcome, preview
from batchapi.batches.diff.runs import Request, Run, open_run, outcomes, requests
from batchapi.context import Context
from batchapi.errors import InvalidRequest

MAX_FINGERPRINTS = 10  # listed per side


class Change(StrEnum):
    OUTPUT = "output_changed"  # both succeeded, the model's output differs
    STATUS = "status_changed"  # succeeded on one side, failed on the other
    ERROR = "error_changed"  # failed on both sides, with other error codes
    ONLY_BATCH = "only_in_batch"
    ONLY_AGAINST = "only_in_against"
    USAGE = "usage_changed"  # the same output, other prompt or completion token counts


ORDER = list(Change)  # the listing's order, after the reproducibility breaks


@dataclass(frozen=True)
class Seen:
    """What the first pass keeps of one result."""

    succeeded: bool
    digest: bytes
    prompt_tokens: int
    completion_tokens: int
    system_fingerprint: str | None

    @classmethod
    def of(cls, o: Outcome) -> Seen:
        return cls(o.succeeded, o.digest, o.prompt_tokens, o.completion_tokens, o.system_fingerprint)


@dataclass(frozen=True)
class Side:
    """A listed request's result in one batch."""

    status: str  # "succeeded" or "failed"
    output: str  # a short text of it (outcomes.preview)
    prompt_tokens: int
    completion_tokens: int
    system_fingerprint: str | None
    error_code: str | None

    @classmethod
    def of(cls, o: Outcome) -> Side:
        code = None if o.succeeded or not isinstance(o.output, dict) else o.output.get("code")
        return cls("succeeded" if o.succeeded else "failed", preview(o), o.prompt_tokens, o.completion_tokens,
                   o.system_fingerprint, code)


@dataclass
class Difference:
    custom_id: str
    change: Change
    reproducibility_break: bool = False
    same_fingerprint: bool | None = None  # None: a side has none (a failure, a format without one)
    same_request: bool | None = None  # None: an input file is gone
    deterministic: bool | None = None
    prompt_tokens_delta: int | None = None
    completion_tokens_delta: int | None = None
    batch: Side | None = None
    against: Side | None = None


@dataclass
class Summary:
    batch_requests: int = 0
    against_requests: int = 0
    compared: int = 0  # on both sides
    identical: int = 0
    output_changed: int = 0
    reproducibility_breaks: int = 0
    usage_changed: int = 0
    status_changed: int = 0
    error_changed: int = 0
    only_in_batch: int = 0
    only_in_against: int = 0
    different_fingerprints: int = 0
    prompt_tokens_delta: int = 0  # over the requests that succeeded on both sides
    completion_tokens_delta: int = 0
    unnamed: int = 0  # results without a custom_id, which cannot be matched


@dataclass
class BatchDiff:
    batch_id: str
    against: str
    endpoint: str
    inputs_compared: bool
    summary: Summary
    fingerprints: dict[str, list[str]]  # the distinct system_fingerprints of each side (the first 10)
    data: list[Difference]
    has_more: bool

    @property
    def reproducible(self) -> bool:
        return self.summary.reproducibility_breaks == 0


@dataclass
class _Found:
    """The differences kept for the listing: at most ``limit`` of each kind."""

    limit: int
    breaks: list[Difference] = field(default_factory=list)
    by_change: dict[Change, list[Difference]] = field(default_factory=lambda: {c: [] for c in Change})
    total: int = 0

    def add(self, d: Difference) -> bool:
        """Count ``d``; whether it is kept."""
        self.total += 1
        kept = self.breaks if d.reproducibility_break else self.by_change[d.change]
        if len(kept) >= self.limit:
            return False
        kept.append(d)
        return True

    def listed(self) -> list[Difference]:
        return (self.breaks + [d for c in ORDER for d in self.by_change[c]])[: self.limit]


def diff_batches(ctx: Context, project_id: str, batch_id: str, against: str, limit: int = 100) -> BatchDiff:
    a = open_run(ctx, project_id, batch_id, "batch_id")
    b = open_run(ctx, project_id, against, "against")
    if a.batch.endpoint != b.batch.endpoint:
        raise InvalidRequest(f"Batch {batch_id} ran {a.batch.endpoint} and batch {against} ran {b.batch.endpoint}; "
                             "only batches of one endpoint can be compared.", "against", code="invalid_value")
    asked_a = requests(ctx, a)
    asked = (asked_a, asked_a if b.input_key == a.input_key else requests(ctx, b))  # a rerun of one file: read once
    summary, found = Summary(), _Found(limit)
    prints: dict[str, dict[str, None]] = {"batch": {}, "against": {}}
    seen: dict[str, Seen] = {}
    for o in outcomes(ctx, a):
        if _count(o, summary, "batch_requests", prints["batch"]):
            seen[o.custom_id] = Seen.of(o)
    for o in outcomes(ctx, b):
        if not _count(o, summary, "against_requests", prints["against"]):
            continue
        old = seen.pop(o.custom_id, None)
        if old is None:
            summary.only_in_against += 1
            d = Difference(o.custom_id, Change.ONLY_AGAINST)
        else:
            d = _compare(o.custom_id, old, Seen.of(o), *(None if r is None else r.get(o.custom_id) for r in asked),
                         summary)
        if d is not None and found.add(d):
            d.against = Side.of(o)
    for custom_id in seen:
        summary.only_in_batch += 1
        found.add(Difference(custom_id, Change.ONLY_BATCH))
    listed = found.listed()
    _fill(ctx, listed, a)
    return BatchDiff(batch_id, against, a.batch.endpoint, None not in asked, summary,
                     {side: list(values) for side, values in prints.items()},
                     listed, found.total > len(listed))


def _count(o: Outcome, summary: Summary, counter: str, prints: dict[str, None]) -> bool:
    """Count a result of one side; False for one without a ``custom_id``."""
    if o.custom_id is None:
        summary.unnamed += 1
        return False
    setattr(summary, counter, getattr(summary, counter) + 1)
    if o.system_fingerprint is not None and len(prints) < MAX_FINGERPRINTS:
        prints.setdefault(o.system_fingerprint)
    return True


def _compare(custom_id: str, old: Seen, new: Seen, asked_a: Request | None, asked_b: Request | None,
             summary: Summary) -> Difference | None:
    summary.compared += 1
    d = Difference(custom_id, Change.OUTPUT)
    if old.system_fingerprint is not None and new.system_fingerprint is not None:
        d.same_fingerprint = old.system_fingerprint == new.system_fingerprint
        summary.different_fingerprints += not d.same_fingerprint
    if asked_a is not None and asked_b is not None:
        d.same_request = asked_a.digest == asked_b.digest
    known = [r.deterministic for r in (asked_a, asked_b) if r is not None]
    d.deterministic = all(known) if known else None
    if old.succeeded and new.succeeded:
        d.prompt_tokens_delta = new.prompt_tokens - old.prompt_tokens
        d.completion_tokens_delta = new.completion_tokens - old.completion_tokens
        summary.prompt_tokens_delta += d.prompt_tokens_delta
        summary.completion_tokens_delta += d.completion_tokens_delta
    if old.succeeded != new.succeeded:
        d.change = Change.STATUS
    elif old.digest != new.digest:
        d.change = Change.OUTPUT if old.succeeded else Change.ERROR
        d.reproducibility_break = (old.succeeded and d.same_fingerprint is True and d.same_request is not False
                                   and d.deterministic is not False)
    elif d.prompt_tokens_delta or d.completion_tokens_delta:
        d.change = Change.USAGE
    else:
        summary.identical += 1
        return None
    setattr(summary, d.change.value, getattr(summary, d.change.value) + 1)
    summary.reproducibility_breaks += d.reproducibility_break
    return d


def _fill(ctx: Context, listed: list[Difference], a: Run) -> None:
    """The listed requests' results in ``batch``, from one more pass over its files (``against``'s
    were kept as they were found)."""
    wanted = {d.custom_id: d for d in listed if d.change != Change.ONLY_AGAINST}
    if not wanted:
        return
    for o in outcomes(ctx, a, only=wanted):
        d = wanted.get(o.custom_id) if o.custom_id is not None else None
        if d is not None:
            d.batch = Side.of(o)

"""Request and response bodies, in the shapes of the OpenAI Files and Batches API."""

from __future__ import annotations

from dataclasses import asdict
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from batchapi.batches.billing import cache_savings, cost, estimated_cost, format_amount, usage
from batchapi.batches.states import BatchStatus
from batchapi.db.models import Batch, File
from batchapi.openai.body import ENDPOINTS


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, row: File) -> FileObject:
        return cls(id=row.id, bytes=row.bytes, created_at=row.created_at, filename=row.filename, purpose=row.purpose,
                   expires_at=row.expires_at)


class _Page:
    """``of`` for the cursor-paged lists: ``first_id`` and ``last_id`` come from ``data``."""

    @classmethod
    def of(cls, data: list, has_more: bool):
        return cls(data=data, first_id=data[0].id if data else None,
                   last_id=data[-1].id if data else None, has_more=has_more)


class FileList(_Page, BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy: ``seconds`` after ``anchor`` (``created_at``), 3600 to 2592000;
    the range is checked by ``batches.files.expiry_seconds``, which names the param."""

    anchor: str
    seconds: int


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str = Field(description=f"the url of every line: one of {', '.join(ENDPOINTS)}")  # checked by the service
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None  # of the output and error files
    # beyond OpenAI: false to run every request, none answered from the result cache
    result_cache: bool = True
    # beyond OpenAI: the batch's order among its project's batches (higher first), and a spend cap
    # in the batch's currency (a decimal string or a number) that stops it as a cancel does
    priority: int = 0
    max_cost: Decimal | None = None


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Cost(BaseModel):
    """Beyond OpenAI: decimal strings, ``amount`` at the batch price, ``list_amount`` at list price;
    a batch some of whose requests the result cache answered also has ``cached_requests`` and
    ``cached_amount`` (what they would have cost, not charged: ``billing.cache_savings``)."""

    model_config = ConfigDict(extra="allow")

    currency: str
    amount: str
    list_amount: str


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: dict | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: dict
    metadata: dict[str, str] | None
    cost: Cost
    estimated_cost: Cost | None
    request_errors: dict | None = None  # beyond OpenAI: body problems of single requests (their 400s)
    retry_of: str | None = None  # beyond OpenAI: the batch this one retries (POST /v1/batches/{id}/retry)
    # beyond OpenAI (docs/API_EXTENSIONS.md, "Sharing a deployment"): the batch's priority within its
    # project; its spend cap; while it runs, when the fleet's measured rate has it finish under the
    # fair share; since when it is served first because it could not otherwise meet its window
    priority: int = 0
    max_cost: str | None = None
    estimated_completion_at: int | None = None
    deadline_risk_at: int | None = None

    @classmethod
    def of(cls, b: Batch) -> BatchObject:
        estimate = estimated_cost(b)
        return cls(
            id=b.id, endpoint=b.endpoint, model=b.model, errors=b.errors, input_file_id=b.input_file_id,
            completion_window=b.completion_window, status=b.status, output_file_id=b.output_file_id,
            error_file_id=b.error_file_id, created_at=b.created_at, in_progress_at=b.in_progress_at,
            expires_at=b.expires_at, finalizing_at=b.finalizing_at, completed_at=b.completed_at,
            failed_at=b.failed_at, expired_at=b.expired_at, cancelling_at=b.cancelling_at,
            cancelled_at=b.cancelled_at,
            request_counts=RequestCounts(total=b.request_total, completed=b.request_completed, failed=b.request_failed),
            usage=usage(b), metadata=b.metadata_, cost=Cost(**cost(b).as_dict(), **cache_savings(b)),
            estimated_cost=Cost(**estimate.as_dict()) if estimate else None, request_errors=b.request_errors,
            retry_of=b.retry_of, priority=b.priority or 0,
            max_cost=format_amount(b.max_cost) if b.max_cost is not None else None,
            estimated_completion_at=b.estimated_completion_at if b.status == BatchStatus.IN_PROGRESS else None,
            deadline_risk_at=b.deadline_risk_at,
        )


class DryRunRequest(BaseModel):
    """Beyond OpenAI: a batch's create body, to see what a batch of the file would meet."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str = "24h"
    priority: int = 0


class DryRunErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict]


class DryRunObject(BaseModel):
    """Beyond OpenAI (docs/API_EXTENSIONS.md, "Dry runs"): what a batch of the file would meet.
    ``valid`` false: ``errors`` would fail it. ``prompt_tokens`` are exact; ``max_output_tokens``
    the max_tokens bound; ``enqueued_tokens`` what a quota counts for it as it starts (validation's
    bounds); ``estimated_completion_at`` null until the fleet has a measured rate; ``quota`` the
    error that would fail it as it starts (``token_limit_exceeded``, ...), or null."""

    object: Literal["batch.dry_run"] = "batch.dry_run"
    input_file_id: str
    endpoint: str
    completion_window: str
    model: str | None
    valid: bool
    errors: DryRunErrors | None
    request_errors: dict | None
    request_counts: RequestCounts
    prompt_tokens: int
    max_output_tokens: int
    enqueued_tokens: int
    estimated_cost: Cost | None
    estimated_completion_at: int | None
    fleet_tokens_per_second: float | None
    quota: dict | None

    @classmethod
    def of(cls, run) -> DryRunObject:
        return cls(
            input_file_id=run.input_file_id, endpoint=run.endpoint, completion_window=run.completion_window,
            model=run.model, valid=not run.errors,
            errors=DryRunErrors(data=[e.as_dict() for e in run.errors]) if run.errors else None,
            request_errors=run.request_errors,
            request_counts=RequestCounts(total=run.request_total, completed=0, failed=0),
            prompt_tokens=run.prompt_tokens, max_output_tokens=run.max_output_tokens,
            enqueued_tokens=run.enqueued_tokens, estimated_cost=Cost(**run.estimated_cost.as_dict()) if run.estimated_cost else None,
            estimated_completion_at=run.estimated_completion_at,
            fleet_tokens_per_second=round(run.fleet_rate, 1) if run.fleet_rate is not None else None,
            quota={"code": run.quota[0], "message": run.quota[1]} if run.quota else None,
        )


class BatchList(_Page, BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool



class DiffSide(BaseModel):
    """A listed request's result in one of the two batches."""

    status: Literal["succeeded", "failed"]
    output: str = Field(description="the answer, tool calls, vectors' sizes or error, cut to 600 characters")
    prompt_tokens: int
    completion_tokens: int
    system_fingerprint: str | None
    error_code: str | None


class DiffEntry(BaseModel):
    custom_id: str
    change: Literal["output_changed", "status_changed", "error_changed", "only_in_batch", "only_in_against",
                    "usage_changed"]
    reproducibility_break: bool
    same_fingerprint: bool | None
    same_request: bool | None
    deterministic: bool | None
    prompt_tokens_delta: int | None
    completion_tokens_delta: int | None
    batch: DiffSide | None
    against: DiffSide | None


class DiffSummary(BaseModel):
    batch_requests: int
    against_requests: int
    compared: int
    identical: int
    output_changed: int
    reproducibility_breaks: int
    usage_changed: int
    status_changed: int
    error_changed: int
    only_in_batch: int
    only_in_against: int
    different_fingerprints: int
    prompt_tokens_delta: int
    completion_tokens_delta: int
    unnamed: int


class BatchDiffObject(BaseModel):
    """batchapi's run-to-run diff of two ended batches (docs/API_EXTENSIONS.md)."""

    object: Literal["batch.diff"] = "batch.diff"
    batch_id: str
    against: str
    endpoint: str
    reproducible: bool
    inputs_compared: bool
    summary: DiffSummary
    system_fingerprints: dict[str, list[str]]
    data: list[DiffEntry]
    has_more: bool

    @classmethod
    def of(cls, diff) -> BatchDiffObject:
        """From a ``batches.diff.compare.BatchDiff``."""
        return cls(batch_id=diff.batch_id, against=diff.against, endpoint=diff.endpoint,
                   reproducible=diff.reproducible, inputs_compared=diff.inputs_compared,
                   summary=asdict(diff.summary), system_fingerprints=diff.fingerprints,
                   data=[asdict(d) for d in diff.data], has_more=diff.has_more)

class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchapi"
    # batchapi's: read from the model's config.json at start; null where it is not pulled on the API's host
    architecture: str | None = Field(None, description="config.json's architectures[0], or its model_type")
    context_length: int | None = Field(None, description="the tokens one input may hold: max_position_embeddings,"
                                       " or an embedding model's sentence-transformers max_seq_length")
    kind: Literal["chat", "embedding"] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    database: str
    storage: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response, as OpenAI's."""

    error: ErrorDetail


ERRORS = {
    400: "The request is malformed or holds a value the service does not take.",
    401: "The API key is missing, unknown or revoked.",
    404: "No such object in this project (another project's objects look the same).",
    409: "The object's state does not allow this (a finished batch cancelled, an idempotency key reused).",
    413: "The request body is larger than the limit.",
    431: "The request line and headers are larger than the limit.",
    429: "Over a limit that passes with time: the project's quota of unfinished work, or too many at once.",
    503: "The database or the storage cannot be reached.",
}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """The ``responses=`` of a route or router that may answer with these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}

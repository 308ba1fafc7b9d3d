"""SQLAlchemy 2 models: projects and their API keys, files, batches and the shards of a batch.

Timestamps are Unix seconds (integers), as the API shows them, so every comparison in SQL
(lease expiry, batch expiry) is plain integer arithmetic on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    Numeric,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

PRICE = Numeric(20, 10)


class Base(DeclarativeBase):
    type_annotation_map = {int: BigInteger, bool: Boolean, dict[str, Any]: JSON, list[int]: JSON}


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[int]
    # its share of the fleet against other projects' (``batches.sharing.fair_share``); `batchapi projects set`
    weight: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class Quota(Base):
    """A project's limits for one model (``model`` empty: every model it has no row of its own
    for), checked when a batch starts (``batches.sharing.quotas``); a None limit falls back to the
    deployment's (``BATCHAPI_QUOTA_*``), 0 is no limit."""

    __tablename__ = "quotas"

    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    enqueued_tokens: Mapped[int | None]  # estimated tokens of its unfinished batches
    unfinished_batches: Mapped[int | None]


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    prefix: Mapped[str] = mapped_column(String(16))  # shown to people to tell keys apart
    created_at: Mapped[int]
    revoked_at: Mapped[int | None]
    # an admin key reads every project's usage and costs (`batchapi keys create --admin`)
    admin: Mapped[bool] = mapped_column(default=False, server_default="0")


class DashboardSession(Base):
    """A dashboard sign-in: the cookie holds the token, this row only its SHA-256. Signing out
    deletes the row; a revoked key ends its sessions, since each request checks the key too."""

    __tablename__ = "dashboard_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[int]
    expires_at: Mapped[int]


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_project_created", "project_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int]
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[int]
    deleted_at: Mapped[int | None] = mapped_column(index=True)  # indexed for the sweeper's clean-up
    # past it the sweeper deletes the object and the row (``expires_after``; batch input: 30 days)
    expires_at: Mapped[int | None] = mapped_column(index=True)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_project_created", "project_id", "created_at", "id"),
        Index("ix_batches_status", "status"),
        UniqueConstraint("project_id", "idempotency_key", name="uq_batches_idempotency"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    # set by validation; of a Message Batch whose requests name several models, the first of them
    model: Mapped[str | None] = mapped_column(String(256))
    # a batch of several models (a Message Batch): model id -> its price, request counts, usage and
    # estimate (``billing.model_parts``); None for a batch of one model, whose columns say it all
    per_model: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    input_file_id: Mapped[str] = mapped_column(String(64), index=True)
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))  # a batches.states.BatchStatus
    errors: Mapped[dict[str, Any] | None]  # why the batch failed (problems of the file)
    # problems of single request bodies found by validation: those requests run as 400s
    request_errors: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    request_fingerprint: Mapped[str | None] = mapped_column(String(64))
    retry_of: Mapped[str | None] = mapped_column(String(64))  # the batch whose unfinished requests this re-runs
    # ``output_expires_after.seconds``: the output and error files expire this long after they are made
    output_expires_after: Mapped[int | None]

    created_at: Mapped[int]
    in_progress_at: Mapped[int | None]
    expires_at: Mapped[int]
    finalizing_at: Mapped[int | None]
    completed_at: Mapped[int | None]
    failed_at: Mapped[int | None]
    expired_at: Mapped[int | None]
    cancelling_at: Mapped[int | None]
    cancelled_at: Mapped[int | None]
    # a deleted Message Batch: gone for the API, its files and shards removed, its usage still billed
    deleted_at: Mapped[int | None]

    # validation lease: a validator that dies leaves it to expire, and a sweep picks it up again
    validation_lease_expires_at: Mapped[int | None]

    # request counts and usage; workers add to these as shards finish (succeeded requests only)
    request_total: Mapped[int] = mapped_column(default=0)
    request_completed: Mapped[int] = mapped_column(default=0)
    request_failed: Mapped[int] = mapped_column(default=0)
    # of the failed: those cut off by a cancel or expiry, never run (Anthropic's canceled/expired)
    request_unrun: Mapped[int] = mapped_column(default=0, server_default="0")
    input_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    reasoning_tokens: Mapped[int] = mapped_column(default=0, server_default="0")  # of the output: thinking

    # estimates from validation: prompt tokens of every request and the max_tokens bound
    estimated_input_tokens: Mapped[int] = mapped_column(default=0)
    estimated_output_tokens: Mapped[int] = mapped_column(default=0)

    # the price in force when the batch was created, so the bill never changes afterwards
    currency: Mapped[str] = mapped_column(String(8), default="usd")
    price_input: Mapped[Decimal] = mapped_column(PRICE)  # list price per 1M tokens
    price_cached_input: Mapped[Decimal] = mapped_column(PRICE)
    price_output: Mapped[Decimal] = mapped_column(PRICE)
    discount_percent: Mapped[Decimal] = mapped_column(Numeric(6, 3))

    # the result cache (``batches.result_cache``): False when the batch asked for it off; of the
    # completed requests, those answered from the cache, and the usage they would have cost
    result_cache: Mapped[bool] = mapped_column(default=True, server_default="1")

    # sharing the fleet (``batches.sharing.fair_share``): the order of the project's batches (higher
    # first); when the planner expects it to finish; when it found the batch unable to meet its
    # window under the fair share (from then on it is served before other projects' batches)
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    estimated_completion_at: Mapped[int | None]
    deadline_risk_at: Mapped[int | None]
    # a spend cap in ``currency`` at the batch price: reaching it stops the batch as a cancel does
    max_cost: Mapped[Decimal | None] = mapped_column(PRICE)
    cached_requests: Mapped[int] = mapped_column(default=0, server_default="0")
    cache_saved_input_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    cache_saved_cached_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    cache_saved_output_tokens: Mapped[int] = mapped_column(default=0, server_default="0")


class Shard(Base):
    """A run of input lines of one model, the unit a worker claims.

    ``start_byte``/``end_byte`` are the half-open byte range of the input object holding lines
    ``first_line``..``last_line`` (1-based, inclusive); blank lines inside it are not requests.
    In a batch of several models a model's requests sit between other models' lines: ``lines``
    then names the shard's own (their line numbers, ascending), and the rest of the range is not
    the shard's.
    """

    __tablename__ = "shards"
    __table_args__ = (
        UniqueConstraint("batch_id", "index", name="uq_shards_batch_index"),
        Index("ix_shards_status_lease", "status", "lease_expires_at"),
        Index("ix_shards_started", "started_at"),  # the fair share's window of given work
        Index("ix_shards_batch_status", "batch_id", "status", "index"),  # a batch's first queued shard
    )

    id: Mapped[str] = mapped_column(String(80), primary_key=True)  # f"{batch_id}_{index:05d}"
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    first_line: Mapped[int]
    last_line: Mapped[int]
    start_byte: Mapped[int]
    end_byte: Mapped[int]
    request_count: Mapped[int]
    model: Mapped[str | None] = mapped_column(String(256))  # the served model that runs it
    lines: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True))  # None: every line of the range
    # prompt tokens: an upper bound from validation, exact once ``tokens_counted`` (a background
    # pass after the batch started fills ``prompt_token_counts``, one per request in line order)
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    estimated_output_tokens: Mapped[int] = mapped_column(default=0)  # max_tokens bound
    tokens_counted: Mapped[bool] = mapped_column(default=False)
    prompt_token_counts: Mapped[list[int] | None]

    status: Mapped[str] = mapped_column(String(16))  # a batches.states.ShardStatus
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims: each attempt's number fences it
    # of the claims, those its worker gave back (shutting down, the shard unreadable): not lost leases
    given_back: Mapped[int] = mapped_column(default=0, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[int | None]
    output_key: Mapped[str | None] = mapped_column(String(512))
    error_key: Mapped[str | None] = mapped_column(String(512))
    last_error: Mapped[str | None] = mapped_column(Text)

    completed_count: Mapped[int] = mapped_column(default=0)
    failed_count: Mapped[int] = mapped_column(default=0)
    unrun_count: Mapped[int] = mapped_column(default=0, server_default="0")  # of the failed: never run
    input_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    reasoning_tokens: Mapped[int] = mapped_column(default=0, server_default="0")

    created_at: Mapped[int]
    started_at: Mapped[int | None]
    finished_at: Mapped[int | None]


class RequestResult(Base):
    """One finished request of a shard that is not done yet: its rendered output or error line,
    written within seconds of the engine finishing it, so that neither a crash nor a cancel or
    expiry loses it. ``seq`` is the request's position in its shard (0-based, blank lines not
    counted). A worker that completes the shard moves its rows into the shard's result objects and
    deletes them; rows left on a done shard (the sweeper closed it) are merged into its lines."""

    __tablename__ = "request_results"

    shard_id: Mapped[str] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    succeeded: Mapped[bool]  # in the output file (else the error file)
    line: Mapped[bytes] = mapped_column(LargeBinary)  # the result line, newline included
    input_tokens: Mapped[int] = mapped_column(default=0)  # usage: succeeded requests only
    cached_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    reasoning_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    attempt: Mapped[int] = mapped_column(Integer)  # the shard attempt that ran it


class ResultCacheEntry(Base):
    """One succeeded, deterministic request's response body, served again to a later batch of the
    same project whose request has the same ``key`` (``batches.result_cache``). It lives while
    its batch's output file does: the lookup checks that file, the sweeper deletes the rest."""

    __tablename__ = "result_cache"
    __table_args__ = (Index("ix_result_cache_project_key", "project_id", "key"),)

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 hex of model, fingerprint, body
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    body: Mapped[bytes] = mapped_column(LargeBinary)  # the response body, JSON
    input_tokens: Mapped[int]  # the usage it had
    cached_tokens: Mapped[int]
    output_tokens: Mapped[int]
    created_at: Mapped[int]


class WebhookEndpoint(Base):
    """A project's URL that receives signed events (``batchapi webhooks create``). The signing
    secret is kept as given out: signing needs it. After a rotation the previous one also signs
    until ``previous_secret_expires_at``."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(String(2048))
    event_types: Mapped[list[str]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(128))
    previous_secret: Mapped[str | None] = mapped_column(String(128))
    previous_secret_expires_at: Mapped[int | None]
    created_at: Mapped[int]
    updated_at: Mapped[int]


class WebhookDelivery(Base):
    """The outbox: one event for one endpoint, written in the transaction that ends its batch,
    then sent (and re-sent with backoff) until the endpoint answers 2xx or a day has passed.
    ``payload`` is the exact body, so every attempt signs and sends the same bytes."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    event_id: Mapped[str] = mapped_column(String(64))  # the body's ``id`` and the ``webhook-id`` header
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    batch_id: Mapped[str] = mapped_column(String(64), index=True)
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # a webhooks.outbox.DeliveryStatus
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[int]
    lease_expires_at: Mapped[int | None]  # a sender holds it until then
    last_attempt_at: Mapped[int | None]
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[int]
    delivered_at: Mapped[int | None]


class Upload(Base):
    """An Upload (``POST /v1/uploads``): parts arrive as objects of their own, and completing it
    assembles them, in the order ``part_ids`` gives, into the File ``file_id``."""

    __tablename__ = "uploads"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    mime_type: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int]
    status: Mapped[str] = mapped_column(String(16))  # a batches.uploads.UploadStatus
    file_expires_after: Mapped[int | None]  # ``expires_after.seconds`` of the File it makes
    file_id: Mapped[str | None] = mapped_column(String(64))  # once completed
    created_at: Mapped[int]
    expires_at: Mapped[int] = mapped_column(index=True)


class UploadPart(Base):
    __tablename__ = "upload_parts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int]
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[int]

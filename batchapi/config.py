"""Settings, read from the environment (prefix ``BATCHAPI_``) in this one place.

Everything else receives a ``Settings`` object (or values taken from it); nothing
else in the package reads ``os.environ``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import time
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


class SettingsError(Exception):
    """Invalid configuration; the message names the environment variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHAPI_", extra="ignore")

    # where things live
    data_dir: Path = Path("./batchapi-data")
    database_url: str = ""  # empty: SQLite file in the data dir
    broker_url: str = ""  # empty: embedded in-process worker
    storage_url: str = ""  # empty: file:// data dir / "storage"; s3://bucket/prefix uses boto3
    s3_endpoint_url: str = ""
    s3_region: str = "us-east-1"
    s3_access_key_id: str = ""  # empty: boto3's own credential chain
    s3_secret_access_key: str = ""

    # model and engine
    model: str = DEFAULT_MODEL  # the chat model (the first of ``served_models`` unless BATCHAPI_MODELS says)
    # every model a worker serves, comma-separated names or directories (chat models on the engine,
    # embedding models on the encoder); empty: BATCHAPI_MODEL, plus the default embedding model
    # when BATCHAPI_MODEL is the default (the embedded default serves both)
    models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    model_cache: Path = Path("~/.cache/batchapi")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the engine's choices (batchapi.engine.config.DTYPES / KERNELS; config.py imports nothing of
    # batchapi, so tests/test_config.py checks the two lists agree)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    kernels: Literal["auto", "triton", "cpu", "torch"] = "auto"
    max_num_seqs: int = Field(default=128, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=16)
    kv_cache_gb: float = Field(default=2.0, gt=0)  # CPU pool size
    # CPU: when the pool's pages are faulted in (batchapi.engine.config.PREFAULTS; docs/OPERATIONS.md)
    kv_pool_prefault: Literal["idle", "start", "off"] = "idle"
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    enable_prefix_caching: bool = True
    batch_invariant: bool = True  # a request's tokens do not depend on its batch (docs/USAGE.md, "Reproducible results")
    # CPU: bf16 linear weights in the C kernels, widened to float32 where the CPU computes in float32,
    # by AVX512-BF16 where it has that and no AMX; false: oneDNN (docs/OPERATIONS.md)
    bf16_weights: bool = True
    cuda_graphs: bool = True  # CUDA: decode steps replayed from CUDA graphs (docs/BENCHMARKS.md, "Engine throughput")
    # the engine core in a child process of the worker (batchapi/engine/core.py), where no other
    # Python thread holds its GIL; false: on a thread of the worker's own process
    engine_process: bool = True

    # service
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_workers: int = Field(default=1, ge=1)  # API processes of `batchapi serve`; >1 needs a broker
    access_log: bool = True  # uvicorn's line per request
    # database connections per process; past them a request waits (0 overflow: none opened per request)
    db_pool_size: int = Field(default=20, ge=1)
    db_max_overflow: int = Field(default=0, ge=0)
    # the API's async read connections per process (the polled route, PostgreSQL only)
    db_read_pool_size: int = Field(default=8, ge=1)
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1)
    max_file_lines: int = Field(default=50_000, ge=1)
    max_embedding_inputs: int = Field(default=50_000, ge=1)  # embedding inputs across a batch, as OpenAI
    # one input line (one request); longer lines fail validation as line_too_long unread
    max_line_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    batch_discount_percent: Decimal = Field(default=Decimal(50), ge=0, le=100)
    auth_required: bool = True
    # a key's lookup is reused this long per API process, so a revoked key is refused within it
    auth_cache_seconds: float = Field(default=2.0, ge=0, le=60)
    # the key that signs the thinking blocks of Message Batch results and verifies those sent back;
    # empty: a random one kept in the data dir (one host); a deployment on several hosts sets it
    thinking_secret: str = ""
    # one upload; unset: max_file_bytes (a larger upload would only fail validation later)
    max_upload_bytes: int | None = Field(default=None, ge=1)
    validation_lease_seconds: int = Field(default=300, ge=5)
    # list prices per 1M tokens of any model by its id, as JSON: {"model-id": {"input": "0.2",
    # "cached_input": "0.1", "output": "0.6"}}, each field optional; over the table in
    # batchapi/batches/billing.py
    prices: dict[str, dict[Literal["input", "cached_input", "output"], Annotated[Decimal, Field(ge=0)]]] = Field(
        default_factory=dict)
    # list prices per 1M tokens of the chat model (BATCHAPI_MODEL), over both of those
    price_input_per_mtok: Decimal | None = Field(default=None, ge=0)
    price_cached_input_per_mtok: Decimal | None = Field(default=None, ge=0)
    price_output_per_mtok: Decimal | None = Field(default=None, ge=0)

    # workers
    shard_size: int = Field(default=256, ge=1)
    lease_seconds: int = Field(default=120, ge=5)
    heartbeat_seconds: float = Field(default=10.0, gt=0)
    max_shard_attempts: int = Field(default=3, ge=1)
    sweep_seconds: float = Field(default=5.0, gt=0)
    engine_watermark: int = Field(default=64, ge=0)
    max_shards_in_flight: int = Field(default=4, ge=1)  # per worker engine
    # per-request durability: a worker writes finished requests' results in groups of this many,
    # or after this many seconds, whichever comes first (issue 17)
    result_flush_rows: int = Field(default=64, ge=1)
    result_flush_seconds: float = Field(default=1.0, gt=0, le=60)
    # greedy and seeded requests answered from an earlier batch's identical request (batches.result_cache)
    result_cache: bool = True
    # sharing one deployment (batchapi/batches/sharing/fair_share.py, quotas.py): each project's share of
    # the fleet is its weight (`batchapi projects set`) over the work it was given in this window
    fair_share_window_seconds: int = Field(default=600, ge=10)
    # per project and model, unless `batchapi projects set` says otherwise; 0: no limit
    quota_enqueued_tokens: int = Field(default=0, ge=0)  # estimated tokens of its unfinished batches
    quota_unfinished_batches: int = Field(default=0, ge=0)
    worker_poll_seconds: float = Field(default=2.0, gt=0)  # how often an idle worker looks for shards
    celery_queue: str = "gpu"
    # longer than any shard: Redis redelivers an unacked task only after this
    visibility_timeout_seconds: int = Field(default=3 * 3600, ge=60)

    # webhooks (batchapi/webhooks/): a failed delivery is retried after this many seconds, the wait
    # doubling up to an hour, until the event is webhook_max_age_seconds old; one POST's time limit
    webhook_retry_seconds: float = Field(default=5.0, ge=1)
    webhook_max_age_seconds: int = Field(default=86400, ge=60)
    webhook_timeout_seconds: float = Field(default=10.0, gt=0, le=60)
    # an endpoint on a private, loopback, link-local or other non-public address is refused at
    # registration and delivery (an API key must not make the service POST into its own network),
    # unless allowed here: all of them, or these host names and networks (comma-separated)
    webhook_allow_private: bool = False
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # operations (batchapi/logs.py, batchapi/metrics.py, the dashboard)
    log_format: Literal["text", "json"] = "text"  # one JSON object per line with "json"
    metrics_port: int = Field(default=0, ge=0, le=65535)  # `batchapi worker`'s /metrics port; 0: none
    # set by `batchapi serve` for its worker child: the loopback port of the child's engine
    # metrics, which serve's own /metrics adds (batchapi/workers/embedded.py); not for people to set
    embedded_metrics_port: int = Field(default=0, ge=0, le=65535)
    dashboard_session_hours: float = Field(default=12.0, gt=0)  # a dashboard sign-in lasts this long
    # the dashboard cookie's Secure flag. auto: on https requests as uvicorn sees them (it takes
    # X-Forwarded-Proto from the proxies in its FORWARDED_ALLOW_IPS, loopback by default); true behind
    # a TLS-terminating proxy on another host
    cookie_secure: Literal["auto", "true", "false"] = "auto"
    # the URL clients reach the API at (https://batch.example.com), for the links the API hands out
    # (a Message Batch's results_url); empty: the request's own scheme, host and port
    public_url: str = ""
    # without public_url, the hosts (host or host:port, comma-separated) whose Host header may name
    # the links the API hands out; a request from any other Host gets links to host:port above
    trusted_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # prometheus_client's own variable (it reads it too): a directory where API processes share their
    # HTTP metrics; `batchapi serve --workers N` makes a fresh one when it is unset
    prometheus_multiproc_dir: str = Field(default="", validation_alias="PROMETHEUS_MULTIPROC_DIR")

    @field_validator("data_dir", "model_cache")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value and not re.fullmatch(r"https?://[^/?#\s]+(/[^?#\s]*)?", value):
            raise ValueError("must be an http(s) URL with no query or fragment, e.g. https://batch.example.com")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value):
        if isinstance(value, str):
            value = value.split(",")
        return [name.strip() for name in value if name.strip()]

    @field_validator("trusted_hosts", mode="before")
    @classmethod
    def _split_trusted(cls, value):
        if isinstance(value, str):
            value = value.split(",")
        return [host.strip().lower() for host in value if host.strip()]

    @field_validator("webhook_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value):
        if isinstance(value, str):
            value = value.split(",")
        hosts = [host.strip().lower().rstrip(".") for host in value if host.strip()]
        for host in hosts:
            if "/" in host or ":" in host or host.replace(".", "").isdigit():  # meant as an address or network
                try:
                    ipaddress.ip_network(host, strict=False)
                except ValueError:
                    raise ValueError(f"{host!r} is neither a host name nor an IP network") from None
        return hosts

    @field_validator("database_url")
    @classmethod
    def _database_scheme(cls, value: str) -> str:
        if value and not value.startswith(("sqlite", "postgresql", "postgres")):
            raise ValueError("must be a sqlite:// or postgresql:// URL")
        return value

    @field_validator("storage_url")
    @classmethod
    def _storage_scheme(cls, value: str) -> str:
        if value and not value.startswith(("file://", "s3://")):
            raise ValueError("must be a file:// or s3://bucket/prefix URL")
        return value

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "amqp://", "pyamqp://")):
            raise ValueError("must be a redis:// or amqp:// URL")
        return value

    @model_validator(mode="after")
    def _upload_within_file_limit(self) -> Settings:
        if self.max_upload_bytes is None:
            self.max_upload_bytes = self.max_file_bytes
        elif self.max_upload_bytes > self.max_file_bytes:
            raise ValueError("BATCHAPI_MAX_UPLOAD_BYTES must be at most BATCHAPI_MAX_FILE_BYTES")
        return self

    @model_validator(mode="after")
    def _api_workers_need_broker(self) -> Settings:
        if self.api_workers > 1 and not self.broker_url:
            raise ValueError("BATCHAPI_API_WORKERS above 1 needs BATCHAPI_BROKER_URL (without one, the "
                             "worker runs inside the one API process)")
        return self

    @model_validator(mode="after")
    def _heartbeat_inside_lease(self) -> Settings:
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError(
                "BATCHAPI_HEARTBEAT_SECONDS must be at most half of BATCHAPI_LEASE_SECONDS"
            )
        return self

    # derived values, so callers never rebuild defaults themselves

    @property
    def sqlalchemy_url(self) -> str:
        """The database URL with a driver chosen: plain postgresql:// gets psycopg 3."""
        url = self.database_url or f"sqlite:///{(self.data_dir / 'batchapi.db').resolve()}"
        for plain in ("postgres://", "postgresql://"):
            if url.startswith(plain):
                return "postgresql+psycopg://" + url[len(plain) :]
        return url

    @property
    def resolved_storage_url(self) -> str:
        return self.storage_url or f"file://{(self.data_dir / 'storage').resolve()}"

    @property
    def sweep_queue(self) -> str:
        """The beat's own queue, so a sweep never waits behind the shard queue's long tasks."""
        return f"{self.celery_queue}-sweep"

    @property
    def served_models(self) -> list[str]:
        """The names (aliases or directories) of every model this deployment serves."""
        if self.models:
            return list(self.models)
        return [self.model, DEFAULT_EMBEDDING_MODEL] if self.model == DEFAULT_MODEL else [self.model]

    def thinking_key(self) -> bytes:
        """``thinking_secret``, or the data dir's own key, made on first use (readable by its owner only)."""
        if self.thinking_secret:
            return self.thinking_secret.encode()
        path = self.data_dir / "thinking.key"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:  # two processes starting at once: the first writes it, the other reads it
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(secrets.token_hex(32))
            except FileExistsError:
                pass
        for _ in range(50):
            key = path.read_text().strip()
            if key:
                return key.encode()
            time.sleep(0.01)  # written by a process that started at the same moment
        raise SettingsError(f"{path} is empty; delete it or set BATCHAPI_THINKING_SECRET")

    @property
    def embedded(self) -> bool:
        return not self.broker_url


def load_settings(**overrides) -> Settings:
    """Build settings, turning pydantic's errors into one message naming the variables."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            name = f"BATCHAPI_{field.upper()}" if field else "BATCHAPI_*"
            problems.append(f"{name}: {err['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None

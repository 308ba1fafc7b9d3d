"""Prometheus metrics (``prometheus_client``), in two parts by where the truth lives.

- ``DatabaseCollector``, registered in the API's registry, reads the job tables at scrape time:
  batches by status, finished requests by outcome, input/cached/output tokens by model (the sums
  of the batches' own usage, so they match a batch's usage exactly and nothing is lost when a
  worker dies), queued and running shards per model, shard lease recoveries, and webhook
  deliveries by status with their sends and failed sends. Every API process answers the same numbers.
- ``EngineStats``, one per process that runs an engine (``batchapi worker`` on
  ``BATCHAPI_METRICS_PORT``; the embedded default through the API's ``/metrics``): running and
  waiting sequences, KV cache usage, the step time histogram, prompt and generation tokens and
  generation tokens/s over the last ``RATE_WINDOW_SECONDS``. An embedding model's encoder reports
  under the same names, labelled by its model: its requests as sequences, one forward as a step,
  input tokens as prompt tokens, and the vectors it made; it has no KV cache and generates
  nothing, so those stay at zero.
- ``HttpMetrics``, ASGI middleware: request latency by method, route template and status. Under
  ``batchapi serve --workers N`` the processes share it through prometheus_client's multiprocess
  files, so any process's ``/metrics`` reports all of them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker

from batchapi.batches.states import OPEN_SHARDS, BatchStatus, ShardStatus
from batchapi.config import Settings
from batchapi.db.models import Batch, Shard, WebhookDelivery
from batchapi.webhooks.outbox import DeliveryStatus

RATE_WINDOW_SECONDS = 10.0
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # others: label "other"


def exposition(*registries: CollectorRegistry) -> bytes:
    """The text format of several registries, one after the other (their names never overlap)."""
    return b"".join(generate_latest(registry) for registry in registries)


# the job tables, at scrape time


class DatabaseCollector:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as session:
            yield from self._batches(session)
            yield from self._requests(session)
            yield from self._tokens(session)
            yield from self._shards(session)
            yield from self._webhooks(session)

    def _batches(self, session: Session) -> Iterator[Metric]:
        metric = GaugeMetricFamily("batchapi_batches", "Batches by status.", labels=["status"])
        for status, count in session.execute(select(Batch.status, func.count()).group_by(Batch.status)):
            metric.add_metric([status], count)
        yield metric

    def _requests(self, session: Session) -> Iterator[Metric]:
        row = session.execute(select(
            func.coalesce(func.sum(Batch.request_completed), 0),
            func.coalesce(func.sum(Batch.request_failed - Batch.request_unrun), 0),
            _unrun_in(BatchStatus.CANCELLING, BatchStatus.CANCELLED),
            _unrun_in(BatchStatus.EXPIRED),
        )).one()
        metric = CounterMetricFamily(
            "batchapi_requests_finished",
            "Requests finished, by outcome: succeeded; errored (ran, or refused, and failed); canceled and "
            "expired (cut off by a cancel or the completion window, never run).", labels=["outcome"])
        for outcome, value in zip(("succeeded", "errored", "canceled", "expired"), row, strict=True):
            metric.add_metric([outcome], int(value))
        yield metric

    def _tokens(self, session: Session) -> Iterator[Metric]:
        rows = session.execute(
            select(Batch.model, func.sum(Batch.input_tokens), func.sum(Batch.cached_tokens),
                   func.sum(Batch.output_tokens), func.sum(Batch.request_completed))
            .where(Batch.model.is_not(None), Batch.per_model.is_(None)).group_by(Batch.model)
        ).all()
        rows = _with_model_shares(rows, session.scalars(select(Batch.per_model).where(Batch.per_model.is_not(None))))
        families = [
            CounterMetricFamily("batchapi_input_tokens", "Prompt tokens of succeeded requests, by model "
                                "(cached ones included).", labels=["model"]),
            CounterMetricFamily("batchapi_cached_input_tokens", "Prompt tokens served from the prefix cache, "
                                "by model.", labels=["model"]),
            CounterMetricFamily("batchapi_output_tokens", "Generated tokens of succeeded requests, by model.",
                                labels=["model"]),
            CounterMetricFamily("batchapi_model_requests", "Succeeded requests, by model.", labels=["model"]),
        ]
        for model, *values in rows:
            for family, value in zip(families, values, strict=True):
                family.add_metric([model], int(value or 0))
        yield from families

    def _shards(self, session: Session) -> Iterator[Metric]:
        model = func.coalesce(Shard.model, Batch.model)  # a shard's own model (a Message Batch's may be several)
        rows = session.execute(
            select(model, Shard.status, func.count(), func.sum(Shard.request_count))
            .join(Batch, Shard.batch_id == Batch.id)
            .where(Shard.status.in_(OPEN_SHARDS)).group_by(model, Shard.status)
        ).all()
        shards = GaugeMetricFamily("batchapi_shards", "Open shards by model and status (queued: the queue "
                                   "depth; running: held by a worker).", labels=["model", "status"])
        queued = GaugeMetricFamily("batchapi_queued_requests", "Requests in queued shards, by model.",
                                   labels=["model"])
        for model, status, count, requests in rows:
            shards.add_metric([model or "", status], count)
            if status == ShardStatus.QUEUED:
                queued.add_metric([model or ""], int(requests or 0))
        yield shards
        yield queued
        recovered = session.scalar(select(func.coalesce(func.sum(Shard.attempts - 1), 0)).where(Shard.attempts > 1))
        yield CounterMetricFamily("batchapi_shard_lease_recoveries", "Shard runs beyond each shard's first: "
                                  "a lease that was lost (a worker died or stalled) or given back, then claimed "
                                  "again.", value=int(recovered))

    def _webhooks(self, session: Session) -> Iterator[Metric]:
        rows = session.execute(
            select(WebhookDelivery.status, func.count(), func.sum(WebhookDelivery.attempts))
            .group_by(WebhookDelivery.status)
        ).all()
        deliveries = GaugeMetricFamily("batchapi_webhook_deliveries", "Webhook deliveries (one event for one "
                                       "endpoint) by status: pending, delivered, failed (gave up).",
                                       labels=["status"])
        attempts = CounterMetricFamily("batchapi_webhook_delivery_attempts", "Webhook sends, by the status "
                                       "their delivery has now.", labels=["status"])
        failed_sends = 0
        for status, count, tries in rows:
            deliveries.add_metric([status], count)
            attempts.add_metric([status], int(tries or 0))
            failed_sends += int(tries or 0) - (count if status == DeliveryStatus.DELIVERED else 0)
        yield deliveries
        yield attempts
        yield CounterMetricFamily("batchapi_webhook_failed_sends", "Webhook sends the endpoint did not answer "
                                  "with a 2xx (each retried until the delivery gives up).", value=failed_sends)


def _unrun_in(*statuses: BatchStatus):
    return func.coalesce(func.sum(case((Batch.status.in_(statuses), Batch.request_unrun), else_=0)), 0)


def api_registry(sessions: sessionmaker[Session] | None = None, shared_dir: str = "") -> CollectorRegistry:
    """The API's registry; with ``shared_dir`` (prometheus_client's multiprocess mode) it reports
    the HTTP metrics of every API process on the port, summed from their files there."""
    registry = CollectorRegistry(auto_describe=True)
    if sessions is not None:
        registry.register(DatabaseCollector(sessions))
    if shared_dir:
        MultiProcessCollector(registry, path=shared_dir)
    return registry


@contextmanager
def shared_across_processes(settings: Settings) -> Iterator[None]:
    """Around ``batchapi serve --workers N``: the processes it starts share their HTTP metrics
    through a fresh directory (``PROMETHEUS_MULTIPROC_DIR``, which prometheus_client reads in each
    process it starts), unless the environment names one already."""
    if settings.prometheus_multiproc_dir:
        yield
        return
    path = tempfile.mkdtemp(prefix="batchapi-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # inherited by the processes uvicorn starts
    try:
        yield
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(path, ignore_errors=True)


# HTTP latency


class HttpMetrics:
    """Latency of every request by method, route template (``/v1/batches/{batch_id}``; paths that
    match no route share ``unmatched``) and status."""

    def __init__(self, app, registry: CollectorRegistry, shared: bool = False):
        """``shared``: the values go to the multiprocess files, which ``api_registry`` reads back."""
        self.app = app
        self.latency = Histogram("batchapi_http_request_duration_seconds", "HTTP request latency.",
                                 ["method", "route", "status"], buckets=HTTP_BUCKETS,
                                 registry=None if shared else registry)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500

        async def observed_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"  # a client's word: no new series
            self.latency.labels(method, route, str(status)).observe(time.perf_counter() - started)


# the engine of this process


class EngineStats:
    """Gauges read from the attached engine fronts at scrape time, and what their step hook records.
    A process normally runs one engine; several of one model (tests) are summed."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.step_seconds = Histogram("batchapi_engine_step_seconds", "Time of one engine step (an encoder's: "
                                      "one forward).", ["model"], buckets=STEP_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("batchapi_engine_prompt_tokens", "Prompt tokens (an encoder's: input tokens "
                                     "encoded) of requests the engine finished.", ["model"], registry=self.registry)
        self.generation_tokens = Counter("batchapi_engine_generation_tokens", "Tokens the engine generated, "
                                         "counted as its requests finish.", ["model"], registry=self.registry)
        self.embeddings = Counter("batchapi_engine_embeddings", "Embedding vectors an encoder made, counted as "
                                  "its requests finish.", ["model"], registry=self.registry)
        self.registry.register(self)
        self._lock = threading.Lock()
        self._fronts: dict[int, tuple[str, object]] = {}
        self._recent: dict[str, deque[tuple[float, int]]] = {}

    def attach(self, model: str, front) -> None:
        with self._lock:
            self._fronts[id(front)] = (model, front)
            self._recent.setdefault(model, deque())
        front.on_step = lambda seconds, results: self._observe(model, seconds, results)

    def detach(self, front) -> None:
        front.on_step = None
        with self._lock:
            self._fronts.pop(id(front), None)

    @property
    def attached(self) -> bool:
        return bool(self._fronts)

    def _observe(self, model: str, seconds: float, results) -> None:  # on the engine or encoder thread
        self.step_seconds.labels(model).observe(seconds)
        generated = sum(result.completion_tokens for result in results)
        # an encoder's results carry vectors, a chat engine's none
        vectors = sum(len(getattr(result, "vectors", ())) for result in results)
        if results:
            self.prompt_tokens.labels(model).inc(sum(result.prompt_tokens for result in results))
            self.generation_tokens.labels(model).inc(generated)
        if vectors:
            self.embeddings.labels(model).inc(vectors)
        with self._lock:
            self._recent[model].append((time.monotonic(), generated))

    def _rate(self, model: str) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_SECONDS
        recent = self._recent[model]
        while recent and recent[0][0] < cutoff:
            recent.popleft()
        return sum(tokens for _, tokens in recent) / RATE_WINDOW_SECONDS

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("batchapi_engine_running_sequences", "Sequences in the engine's running "
                                    "batch (an encoder's: requests in the round it encodes).", labels=["model"])
        waiting = GaugeMetricFamily("batchapi_engine_waiting_sequences", "Sequences waiting for a place "
                                    "(and requests not yet taken in; an encoder's: requests queued for its "
                                    "next round).", labels=["model"])
        kv = GaugeMetricFamily("batchapi_engine_kv_cache_usage_ratio", "Fraction of the KV cache's blocks in "
                               "use (0 to 1).", labels=["model"])
        rate = GaugeMetricFamily("batchapi_engine_generation_tokens_per_second", "Generated tokens per second "
                                 f"over the last {RATE_WINDOW_SECONDS:g} s.", labels=["model"])
        with self._lock:
            by_model: dict[str, list] = {}
            for model, front in self._fronts.values():
                by_model.setdefault(model, []).append(front)
            for model, fronts in by_model.items():
                running.add_metric([model], sum(front.num_running() for front in fronts))
                waiting.add_metric([model], sum(front.num_waiting() for front in fronts))
                kv.add_metric([model], sum(front.kv_usage() for front in fronts) / len(fronts))
                rate.add_metric([model], self._rate(model))
        yield from (running, waiting, kv, rate)

    def describe(self) -> list:
        return []  # only collected at scrape time: reading the fronts at registration is pointless


_engine_stats: EngineStats | None = None
_engine_lock = threading.Lock()


def engine_stats() -> EngineStats:
    """This process's one ``EngineStats``, made on first use."""
    global _engine_stats
    with _engine_lock:
        if _engine_stats is None:
            _engine_stats = EngineStats()
        return _engine_stats


def attach_runner(runner) -> None:
    """Report every model of a shard runner (``runner.backends``: model id -> (front, codec)): its
    chat engine and its encoders."""
    for model, (front, _) in runner.backends.items():
        engine_stats().attach(model, front)


def detach_runner(runner) -> None:
    for front, _ in runner.backends.values():
        engine_stats().detach(front)


def serve_engine_metrics(port: int, host: str = "0.0.0.0") -> None:
    """``/metrics`` of this process's engine on its own port (a ``batchapi worker``)."""
    start_http_server(port, addr=host, registry=engine_stats().registry)


def _with_model_shares(rows, shares) -> list[tuple]:
    """The per-model token rows with each share of the batches of several models added to its
    model (``Batch.per_model``)."""
    sums = {model: [int(v or 0) for v in values] for model, *values in rows}
    for per_model in shares:
        for model, share in per_model.items():
            total = sums.setdefault(model, [0, 0, 0, 0])
            for i, name in enumerate(("input_tokens", "cached_tokens", "output_tokens", "request_completed")):
                total[i] += share[name]
    return [(model, *values) for model, values in sums.items()]

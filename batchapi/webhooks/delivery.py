"""Sending the outbox, at least once. Each due row is claimed with a conditional UPDATE (a lease,
so two senders never post it at once and a sender that dies leaves it to the next), posted with
fresh Standard Webhooks headers, and its outcome recorded: a 2xx ends it; anything else (a status,
a refused connection, a timeout) counts an attempt and sets the next one after a wait that starts
at ``webhook_retry_seconds`` and doubles up to an hour, until the event is
``webhook_max_age_seconds`` old (a day), when it is given up as ``failed``. The event id stays
the same across attempts, so a receiver can drop repeats. Before each POST the host is resolved and
checked again (``addresses.pin``) and the POST goes to the address checked; a host that now
resolves to a private address, or to nothing, is a failed attempt with no POST.

The sweeper sends on one event loop: ``SENDERS`` posts at once, at most ``PER_ENDPOINT`` of them to
one endpoint, each over within ``webhook_timeout_seconds`` however slowly its receiver answers, so
an endpoint that is slow or never answers holds up no other project's events."""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import httpx
from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from batchapi.config import Settings
from batchapi.db.clock import now
from batchapi.db.ids import new_id
from batchapi.db.models import WebhookDelivery, WebhookEndpoint
from batchapi.db.session import session_scope
from batchapi.webhooks.addresses import ForbiddenAddress, HostUnresolved, Target, pin
from batchapi.webhooks.endpoints import signing_secrets
from batchapi.webhooks.events import event_body
from batchapi.webhooks.outbox import DeliveryStatus
from batchapi.webhooks.signing import signed_headers

log = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 3600
SENDERS = 8  # posts at once
PER_ENDPOINT = 2  # posts at once to one endpoint
ROUND_SECONDS = 2.0  # a sweep starts no new post after this long
MAX_ERROR = 500  # characters of an error kept on the row
USER_AGENT = "batchapi-webhooks/1"


@dataclass
class Outcome:
    status_code: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def retry_wait(settings: Settings, attempts: int) -> int:
    """Seconds before the next attempt, after ``attempts`` failed ones."""
    return int(min(settings.webhook_retry_seconds * 2 ** (attempts - 1), MAX_WAIT_SECONDS))


def deliver_due(sessions: sessionmaker[Session], settings: Settings) -> int:
    """Send what is due for about ``ROUND_SECONDS``, each post taken as another ends (``SENDERS`` at
    once, ``PER_ENDPOINT`` to one endpoint); returns how many were delivered. Each delivery is tried
    at most once a call: one that failed waits out its backoff even where the wait ends within the
    call (waits are whole seconds, so the first one of a second can end a moment after the attempt)."""
    due = _due(sessions, SENDERS)
    if not due:  # the common case: no client, no event loop
        return 0
    return asyncio.run(_deliver(sessions, settings, due))


async def _deliver(sessions: sessionmaker[Session], settings: Settings, due: list[tuple[str, str]]) -> int:
    delivered = 0
    tried: set[str] = set()
    sending: dict[asyncio.Task, str] = {}  # each post in flight, and its endpoint
    started = time.monotonic()
    async with _client(settings) as client:
        while True:
            for delivery_id, endpoint_id in due:
                if len(sending) < SENDERS and list(sending.values()).count(endpoint_id) < PER_ENDPOINT:
                    tried.add(delivery_id)
                    sending[asyncio.create_task(deliver_one(sessions, settings, client, delivery_id))] = endpoint_id
            if not sending:
                return delivered
            done, _ = await asyncio.wait(sending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del sending[task]
                delivered += task.result()
            if time.monotonic() - started < ROUND_SECONDS:
                full = [e for e, n in Counter(sending.values()).items() if n >= PER_ENDPOINT]
                due = await asyncio.to_thread(_due, sessions, SENDERS - len(sending), tried, full)
            else:
                due = []


def _due(sessions: sessionmaker[Session], limit: int, tried: Collection[str] = (),
         full: Collection[str] = ()) -> list[tuple[str, str]]:
    """Due deliveries and their endpoints, the longest due first, at most ``PER_ENDPOINT`` of one
    endpoint (an endpoint with a backlog takes no more of a round than that) and none of ``full``'s."""
    t = now()
    rank = func.row_number().over(partition_by=WebhookDelivery.endpoint_id,
                                  order_by=(WebhookDelivery.next_attempt_at, WebhookDelivery.id))
    listed = select(WebhookDelivery.id, WebhookDelivery.endpoint_id, WebhookDelivery.next_attempt_at,
                    rank.label("rank")).where(
        WebhookDelivery.status == DeliveryStatus.PENDING, WebhookDelivery.next_attempt_at <= t,
        or_(WebhookDelivery.lease_expires_at.is_(None), WebhookDelivery.lease_expires_at < t),
        WebhookDelivery.id.not_in(tried), WebhookDelivery.endpoint_id.not_in(full),
    ).subquery()
    with sessions() as session:
        return [(row.id, row.endpoint_id) for row in session.execute(
            select(listed.c.id, listed.c.endpoint_id).where(listed.c.rank <= PER_ENDPOINT)
            .order_by(listed.c.next_attempt_at, listed.c.id).limit(limit))]


async def deliver_one(sessions: sessionmaker[Session], settings: Settings, client: httpx.AsyncClient,
                      delivery_id: str) -> bool:
    """Claim, post and record one delivery; whether it was delivered now. The database and the
    resolver are asked on threads, so the loop's other posts go on meanwhile."""
    claimed = await asyncio.to_thread(_claim, sessions, settings, delivery_id)
    if claimed is None:
        return False
    url, event_id, payload, secrets = claimed
    try:
        outcome = await post(settings, client, await asyncio.to_thread(pin, settings, url), event_id, payload, secrets)
    except (ForbiddenAddress, HostUnresolved) as exc:
        outcome = Outcome(None, f"{type(exc).__name__}: {exc.message}"[:MAX_ERROR])
    except Exception as exc:  # noqa: BLE001 - a POST that could not be made is a failed attempt: the row
        # backs off and is given up in time, rather than taken again at every lease's end
        log.exception("webhook %s: the POST to its endpoint could not be made", event_id)
        outcome = Outcome(None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR])
    await asyncio.to_thread(_record, sessions, settings, delivery_id, outcome)
    return outcome.ok


def _claim(sessions: sessionmaker[Session], settings: Settings,
           delivery_id: str) -> tuple[str, str, str, list[str]] | None:
    """The delivery leased to this sender while it posts (its URL, event id, payload and signing
    secrets), or None where another sender has it, it is no longer due, or its endpoint is gone."""
    t = now()
    with session_scope(sessions) as session:
        claimed = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == DeliveryStatus.PENDING,
                   # still due: another sweeper listed it too, and may have tried and failed it since
                   WebhookDelivery.next_attempt_at <= t,
                   or_(WebhookDelivery.lease_expires_at.is_(None), WebhookDelivery.lease_expires_at < t))
            .values(lease_expires_at=t + int(settings.webhook_timeout_seconds) + 30)
            .execution_options(synchronize_session=False)
        ).rowcount == 1
        if not claimed:
            return None
        delivery = session.get(WebhookDelivery, delivery_id)
        endpoint = session.get(WebhookEndpoint, delivery.endpoint_id) if delivery is not None else None
        if endpoint is None:  # deleted since the claim, with its deliveries
            return None
        return endpoint.url, delivery.event_id, delivery.payload, signing_secrets(endpoint, t)


async def send_test(settings: Settings, endpoint: WebhookEndpoint, event_type: str) -> Outcome:
    """A sample event (``data.id`` a made-up batch id) posted to ``endpoint`` now, unrecorded;
    ForbiddenAddress or HostUnresolved when it may not be posted. Nothing here holds a thread of
    the API's while it waits: the host is checked (``pin`` resolves it) in the event loop's own
    executor, the POST is async, and the whole test ends within ``webhook_timeout_seconds``."""
    target = await asyncio.to_thread(pin, settings, endpoint.url)
    event_id = new_id("evt_")
    payload = event_body(event_id, event_type, now(), new_id("batch_test_"))
    secrets = signing_secrets(endpoint, now())
    async with _client(settings) as client:
        return await post(settings, client, target, event_id, payload, secrets)


def _client(settings: Settings) -> httpx.AsyncClient:
    # no kept-alive connections: a POST pinned to an address would otherwise reuse a TLS connection
    # to that address made for another host name; no redirects: they could lead anywhere
    return httpx.AsyncClient(timeout=settings.webhook_timeout_seconds, follow_redirects=False, verify=_tls(),
                             headers={"user-agent": USER_AGENT}, limits=httpx.Limits(max_keepalive_connections=0))


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default TLS context, made once: making it reads the CA bundle (some 50 ms of CPU),
    which a client per test would do on the event loop each time."""
    return httpx.create_ssl_context()


async def post(settings: Settings, client: httpx.AsyncClient, target: Target, event_id: str, payload: str,
               secrets: list[str]) -> Outcome:
    """POST the event to ``target``: its answer's status, and the start of its body where that is
    not a 2xx. Over within ``webhook_timeout_seconds``, however slowly an answer trickles in (the
    client's timeout bounds each read, not the whole)."""
    try:
        async with asyncio.timeout(settings.webhook_timeout_seconds):
            # streamed, and only the start of the body read: a receiver answering with gigabytes
            # must not fill the sweeper's memory
            async with client.stream("POST", target.url, content=payload.encode(), headers=_headers(
                    target, event_id, payload, secrets), extensions=target.extensions) as response:
                if 200 <= response.status_code < 300:
                    return Outcome(response.status_code, None)
                head = b""
                async for chunk in response.aiter_bytes():
                    head += chunk
                    if len(head) >= 200:
                        break
    except TimeoutError:
        return Outcome(None, f"no answer within {settings.webhook_timeout_seconds} s")
    except httpx.HTTPError as exc:  # refused, reset, timed out, a bad URL: the endpoint is not there
        return _unanswered(exc)
    return _refused(response.status_code, head)


def _headers(target: Target, event_id: str, payload: str, secrets: list[str]) -> dict[str, str]:
    return {"content-type": "application/json", **target.headers, **signed_headers(event_id, payload, secrets, now())}


def _unanswered(exc: httpx.HTTPError) -> Outcome:
    return Outcome(None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR])


def _refused(status_code: int, head: bytes) -> Outcome:
    """A status other than 2xx (a redirect too: none is followed), with the start of its body."""
    text = head[:200].decode("utf-8", errors="replace")
    return Outcome(status_code, f"HTTP {status_code}: {text}"[:MAX_ERROR])


def _record(sessions: sessionmaker[Session], settings: Settings, delivery_id: str, outcome: Outcome) -> None:
    t = now()
    with session_scope(sessions) as session:
        delivery = session.get(WebhookDelivery, delivery_id)
        if delivery is None:  # its endpoint was deleted meanwhile
            return
        delivery.attempts += 1
        delivery.last_attempt_at = t
        delivery.last_status_code = outcome.status_code
        delivery.last_error = outcome.error
        delivery.lease_expires_at = None
        if outcome.ok:
            delivery.status, delivery.delivered_at = DeliveryStatus.DELIVERED, t
            return
        next_at = t + retry_wait(settings, delivery.attempts)
        if next_at > delivery.created_at + settings.webhook_max_age_seconds:
            delivery.status = DeliveryStatus.FAILED
            log.warning("webhook %s to endpoint %s given up after %d attempts: %s", delivery.event_id,
                        delivery.endpoint_id, delivery.attempts, outcome.error)
        else:
            delivery.next_attempt_at = next_at
            log.info("webhook %s to endpoint %s failed (attempt %d, next in %d s): %s", delivery.event_id,
                     delivery.endpoint_id, delivery.attempts, next_at - t, outcome.error)

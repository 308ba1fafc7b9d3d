"""Webhook events from the transaction that ends a batch to a real HTTP receiver, on PostgreSQL:
signed so that the openai SDK's ``webhooks.unwrap`` verifies them (and refuses a forged body),
retried with backoff when the receiver fails or is down, given up after a day."""

from __future__ import annotations

import asyncio
import ipaddress
import time

import httpx
import openai
import pytest
from sqlalchemy import select, update

from batchapi.batches import states
from batchapi.batches.states import BatchStatus
from batchapi.batches.sweeper import sweep
from batchapi.db.clock import now
from batchapi.db.models import Batch, WebhookDelivery
from batchapi.db.session import session_scope
from batchapi.errors import InvalidRequest
from batchapi.webhooks import addresses, endpoints
from batchapi.webhooks.delivery import PER_ENDPOINT, deliver_due, deliver_one
from batchapi.webhooks.signing import new_secret
from tests.utils.job_rows import make_batch
from tests.utils.services import free_port
from tests.utils.waiting import wait_until
from tests.webhooks.receiver import Receiver, Stalling

SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


@pytest.fixture
def settings(pg_jobs):
    return pg_jobs.settings.model_copy(update={"webhook_retry_seconds": 1.0, "webhook_timeout_seconds": 2.0})


def project_of(ctx, batch_id: str) -> str:
    with ctx.sessions() as session:
        return session.get(Batch, batch_id).project_id


def register(ctx, project_id: str, url: str, events=None):
    with session_scope(ctx.sessions) as session:
        endpoint = endpoints.create_endpoint(session, ctx.settings, project_id, url, events)
        session.flush()
        return endpoint.id, endpoint.secret


def end(ctx, batch_id: str, status: BatchStatus = BatchStatus.COMPLETED) -> None:
    with session_scope(ctx.sessions) as session:
        if status == BatchStatus.COMPLETED:
            assert states.transition(session, batch_id, BatchStatus.FINALIZING)
        elif status == BatchStatus.CANCELLED:
            assert states.transition(session, batch_id, BatchStatus.CANCELLING)
        assert states.transition(session, batch_id, status)


def deliveries(ctx, batch_id: str) -> list[WebhookDelivery]:
    with ctx.sessions() as session:
        return list(session.scalars(select(WebhookDelivery).where(WebhookDelivery.batch_id == batch_id)
                                    .order_by(WebhookDelivery.id)))


def test_a_batch_end_is_signed_delivered_and_verified_by_the_sdk(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    other_batch, _ = make_batch(pg_jobs, 0)  # another project: its endpoint hears nothing of ours
    with Receiver() as receiver, Receiver() as failures_only, Receiver() as elsewhere:
        _, secret = register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        register(pg_jobs, project_of(pg_jobs, batch_id), failures_only.url, ["batch.failed"])
        register(pg_jobs, project_of(pg_jobs, other_batch), elsewhere.url)
        end(pg_jobs, batch_id)
        [row] = deliveries(pg_jobs, batch_id)
        assert (row.status, row.attempts, row.event_type) == ("pending", 0, "batch.completed")

        assert deliver_due(pg_jobs.sessions, settings) == 1
        [got] = receiver.received
        assert failures_only.received == [] and elsewhere.received == []

    event = SDK.webhooks.unwrap(got.body, got.headers, secret=secret)
    assert (event.type, event.object, event.data.id) == ("batch.completed", "event", batch_id)
    assert event.id == got.headers["webhook-id"] == row.event_id and event.id.startswith("evt_")
    assert abs(event.created_at - now()) < 60
    assert got.headers["content-type"] == "application/json"
    [row] = deliveries(pg_jobs, batch_id)
    assert (row.status, row.attempts, row.last_status_code, row.last_error) == ("delivered", 1, 200, None)

    forged = got.body.replace(batch_id.encode(), b"batch_someone_else")
    with pytest.raises(openai.InvalidWebhookSignatureError):
        SDK.webhooks.unwrap(forged, got.headers, secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        SDK.webhooks.unwrap(got.body, got.headers, secret=new_secret())
    assert deliver_due(pg_jobs.sessions, settings) == 0  # delivered once: nothing more is due


def test_each_final_status_sends_its_own_event(pg_jobs, settings):
    with Receiver() as receiver:
        sent = {}
        for status in (BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED):
            batch_id, _ = make_batch(pg_jobs, 0)
            _, secret = register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
            end(pg_jobs, batch_id, status)
            sent[batch_id] = (f"batch.{status}", secret)
        assert deliver_due(pg_jobs.sessions, settings) == 3
    for got in receiver.received:
        batch_id = next(b for b in sent if b.encode() in got.body)
        event = SDK.webhooks.unwrap(got.body, got.headers, secret=sent[batch_id][1])
        assert (event.type, event.data.id) == (sent[batch_id][0], batch_id)
    assert len(receiver.received) == 3


def test_the_event_is_written_with_the_end_or_not_at_all(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    register(pg_jobs, project_of(pg_jobs, batch_id), "http://127.0.0.1:9/never")
    with pg_jobs.sessions() as session:
        assert states.transition(session, batch_id, BatchStatus.EXPIRED)
        session.rollback()  # the end is not committed, so neither is its event
    assert deliveries(pg_jobs, batch_id) == []
    with session_scope(pg_jobs.sessions) as session:
        assert states.transition(session, batch_id, BatchStatus.EXPIRED)
        assert not states.transition(session, batch_id, BatchStatus.EXPIRED)  # a second end moves nothing
    assert [d.event_type for d in deliveries(pg_jobs, batch_id)] == ["batch.expired"]


def test_a_sweep_tries_a_delivery_once_even_when_its_wait_ends_within_the_sweep(pg_jobs, settings):
    # a wait under a second rounds to none: the failed delivery is due again at once, and a sweep
    # that listed what is due again within its round would post it again and again
    batch_id, _ = make_batch(pg_jobs, 0)
    quick = settings.model_copy(update={"webhook_retry_seconds": 0.4})
    with Receiver(statuses=[500, 500, 500]) as receiver:
        register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        end(pg_jobs, batch_id)
        assert deliver_due(pg_jobs.sessions, quick) == 0
        assert [r.status for r in receiver.received] == [500]
        [row] = deliveries(pg_jobs, batch_id)
        assert (row.status, row.attempts, row.next_attempt_at) == ("pending", 1, row.last_attempt_at)
        assert deliver_due(pg_jobs.sessions, quick) == 0  # the next sweep tries it again
        assert [r.status for r in receiver.received] == [500, 500]


def test_a_failing_receiver_is_retried_with_backoff_until_it_answers(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    with Receiver(statuses=[500, 503]) as receiver:
        _, secret = register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        end(pg_jobs, batch_id)
        assert deliver_due(pg_jobs.sessions, settings) == 0
        [row] = deliveries(pg_jobs, batch_id)
        assert (row.status, row.attempts, row.last_status_code) == ("pending", 1, 500)
        assert "HTTP 500" in row.last_error
        assert row.next_attempt_at == row.last_attempt_at + 1  # the first wait, then doubling
        assert deliver_due(pg_jobs.sessions, settings) == 0  # not due again yet
        wait_until(lambda: deliver_due(pg_jobs.sessions, settings), timeout=20, interval=0.2)  # 503, then 200
        [row] = deliveries(pg_jobs, batch_id)
    assert (row.status, row.attempts, row.last_status_code, row.last_error) == ("delivered", 3, 200, None)
    assert [r.status for r in receiver.received] == [500, 503, 200]
    assert len({r.body for r in receiver.received}) == 1  # the same event every time
    assert len({r.headers["webhook-id"] for r in receiver.received}) == 1
    for got in receiver.received:  # each attempt signed afresh
        assert SDK.webhooks.unwrap(got.body, got.headers, secret=secret).data.id == batch_id


def test_a_receiver_that_is_down_gets_the_event_once_it_is_up(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    port = free_port()
    receiver = Receiver(port=port)
    _, secret = register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
    end(pg_jobs, batch_id, BatchStatus.EXPIRED)
    assert deliver_due(pg_jobs.sessions, settings) == 0
    [row] = deliveries(pg_jobs, batch_id)
    assert (row.status, row.attempts, row.last_status_code) == ("pending", 1, None)
    assert "ConnectError" in row.last_error
    with receiver:
        wait_until(lambda: deliver_due(pg_jobs.sessions, settings), timeout=20, interval=0.2)
    [got] = receiver.received
    assert SDK.webhooks.unwrap(got.body, got.headers, secret=secret).type == "batch.expired"
    [row] = deliveries(pg_jobs, batch_id)
    assert (row.status, row.attempts) == ("delivered", 2)


def test_a_delivery_is_given_up_after_a_day(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    with Receiver(statuses=[500]) as receiver:
        register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        end(pg_jobs, batch_id)
        with session_scope(pg_jobs.sessions) as session:  # the event was made a day ago
            session.execute(update(WebhookDelivery).where(WebhookDelivery.batch_id == batch_id)
                            .values(created_at=now() - settings.webhook_max_age_seconds))
        deliver_due(pg_jobs.sessions, settings)
    [row] = deliveries(pg_jobs, batch_id)
    assert (row.status, row.attempts, row.last_status_code) == ("failed", 1, 500)
    assert deliver_due(pg_jobs.sessions, settings) == 0


def test_a_rotated_secret_can_keep_the_old_one_signing_for_a_day(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    with Receiver() as receiver:
        endpoint_id, old = register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        with session_scope(pg_jobs.sessions) as session:
            new = endpoints.rotate_secret(session, endpoint_id, keep_old=True).secret
        end(pg_jobs, batch_id)
        deliver_due(pg_jobs.sessions, settings)
        [got] = receiver.received
        assert len(got.headers["webhook-signature"].split()) == 2
        for secret in (old, new):
            assert SDK.webhooks.unwrap(got.body, got.headers, secret=secret).data.id == batch_id
        with session_scope(pg_jobs.sessions) as session:
            newest = endpoints.rotate_secret(session, endpoint_id).secret
        second, _ = make_batch(pg_jobs, 0)
        with session_scope(pg_jobs.sessions) as session:  # the same endpoint, for the second batch's project
            session.execute(update(Batch).where(Batch.id == second).values(project_id=project_of(pg_jobs, batch_id)))
        end(pg_jobs, second)
        deliver_due(pg_jobs.sessions, settings)
        got = receiver.received[-1]
    assert SDK.webhooks.unwrap(got.body, got.headers, secret=newest).data.id == second
    for secret in (old, new):  # rotated out without the grace: no longer signs
        with pytest.raises(openai.InvalidWebhookSignatureError):
            SDK.webhooks.unwrap(got.body, got.headers, secret=secret)


def test_the_sweep_delivers_and_a_deleted_endpoint_gets_nothing(pg_jobs):
    batch_id, _ = make_batch(pg_jobs, 0)
    gone_batch, _ = make_batch(pg_jobs, 0)
    with Receiver() as receiver, Receiver() as deleted:
        register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        endpoint_id, _ = register(pg_jobs, project_of(pg_jobs, gone_batch), deleted.url)
        end(pg_jobs, batch_id)
        end(pg_jobs, gone_batch)
        with session_scope(pg_jobs.sessions) as session:
            endpoints.delete_endpoint(session, endpoint_id)
        assert deliveries(pg_jobs, gone_batch) == []  # its deliveries went with it
        report = sweep(pg_jobs)
        assert report.webhooks_delivered >= 1
        assert len(receiver.received) == 1 and deleted.received == []


def test_bad_endpoints_are_refused(pg_jobs):
    batch_id, _ = make_batch(pg_jobs, 0)
    project_id = project_of(pg_jobs, batch_id)
    with session_scope(pg_jobs.sessions) as session:
        for url in ("ftp://example.com/x", "not a url", "http:///nohost"):
            with pytest.raises(InvalidRequest) as refused:
                endpoints.create_endpoint(session, pg_jobs.settings, project_id, url)
            assert refused.value.param == "url"
        with pytest.raises(InvalidRequest) as refused:
            endpoints.create_endpoint(session, pg_jobs.settings, project_id, "http://x.test/", ["batch.done"])
        assert refused.value.param == "event_types"


def test_the_embedded_default_delivers_too(sqlite_jobs):
    settings = sqlite_jobs.settings.model_copy(update={"webhook_retry_seconds": 1.0})
    batch_ids = [make_batch(sqlite_jobs, 0)[0] for _ in range(10)]
    with Receiver(statuses=[500] * 3) as receiver:
        for batch_id in batch_ids:  # ten events at once: the senders' parallel writes on SQLite
            register(sqlite_jobs, project_of(sqlite_jobs, batch_id), receiver.url)
            end(sqlite_jobs, batch_id, BatchStatus.CANCELLED)

        def all_delivered() -> bool:
            deliver_due(sqlite_jobs.sessions, settings)
            return all(d.status == "delivered" for b in batch_ids for d in deliveries(sqlite_jobs, b))

        wait_until(all_delivered, timeout=30, interval=0.3)
    assert len(receiver.received) == 13 and sorted(r.status for r in receiver.received) == [200] * 10 + [500] * 3


def test_a_sweeper_that_listed_a_delivery_before_another_failed_it_does_not_send_it_again(pg_jobs, settings):
    # two sweepers list the same due delivery; the first posts, gets a 500 and records the backoff;
    # the second's claim comes after that and must find the delivery no longer due
    batch_id, _ = make_batch(pg_jobs, 0)
    with Receiver(statuses=[500]) as receiver:
        register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        end(pg_jobs, batch_id)
        [row] = deliveries(pg_jobs, batch_id)

        async def twice() -> list[bool]:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return [await deliver_one(pg_jobs.sessions, settings, client, row.id) for _ in range(2)]

        assert asyncio.run(twice()) == [False, False]  # the first: a 500; the second: not claimed
        [row] = deliveries(pg_jobs, batch_id)
    assert row.attempts == 1 and len(receiver.received) == 1


def test_only_the_start_of_a_failing_answer_is_kept(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    with Receiver(statuses=[500], body=b"x" * 5_000_000) as receiver:
        register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        end(pg_jobs, batch_id)
        assert deliver_due(pg_jobs.sessions, settings) == 0
        [row] = deliveries(pg_jobs, batch_id)
    assert row.last_error == "HTTP 500: " + "x" * 200


def test_an_answer_that_trickles_in_is_cut_off_at_the_timeout(pg_jobs, settings):
    batch_id, _ = make_batch(pg_jobs, 0)
    with Stalling(trickle=True) as receiver:
        endpoint_id, _ = register(pg_jobs, project_of(pg_jobs, batch_id), receiver.url)
        end(pg_jobs, batch_id)
        started = time.monotonic()
        assert deliver_due(pg_jobs.sessions, settings) == 0
        assert time.monotonic() - started < settings.webhook_timeout_seconds + 2  # not while it trickles
    [row] = deliveries(pg_jobs, batch_id)
    assert (row.status, row.attempts, row.last_error) == ("pending", 1, "no answer within 2.0 s")
    with session_scope(pg_jobs.sessions) as session:
        endpoints.delete_endpoint(session, endpoint_id)


def test_an_endpoint_that_never_answers_holds_up_no_other_projects_events(pg_jobs, settings):
    silent_batches = [make_batch(pg_jobs, 0)[0]]
    project_id = project_of(pg_jobs, silent_batches[0])
    silent_batches += [make_batch(pg_jobs, 0, project_id=project_id)[0] for _ in range(11)]
    other, _ = make_batch(pg_jobs, 0)
    with Stalling() as silent, Receiver() as receiver:
        endpoint_id, _ = register(pg_jobs, project_id, silent.url)
        for batch_id in silent_batches:  # twelve events due before the other project's one
            end(pg_jobs, batch_id)
        register(pg_jobs, project_of(pg_jobs, other), receiver.url)
        end(pg_jobs, other)
        started = time.monotonic()
        assert deliver_due(pg_jobs.sessions, settings) == 1
        assert time.monotonic() - started < settings.webhook_timeout_seconds + 2
        assert len(receiver.received) == 1 and silent.accepted == PER_ENDPOINT
    tried = [d.attempts for b in silent_batches for d in deliveries(pg_jobs, b)]
    assert sorted(tried) == [0] * (12 - PER_ENDPOINT) + [1] * PER_ENDPOINT
    with session_scope(pg_jobs.sessions) as session:
        endpoints.delete_endpoint(session, endpoint_id)


def test_a_host_name_beyond_ascii_is_sent_in_its_idna_form(pg_jobs, settings, monkeypatch):
    monkeypatch.setattr(addresses, "resolve", lambda host, port: [ipaddress.ip_address("127.0.0.1")])  # it names us
    named = settings.model_copy(update={"webhook_allow_private": False, "webhook_allowed_hosts": ["127.0.0.1/32"]})
    batch_id, _ = make_batch(pg_jobs, 0)
    with Receiver() as receiver:
        with session_scope(pg_jobs.sessions) as session:
            endpoint = endpoints.create_endpoint(session, named, project_of(pg_jobs, batch_id),
                                                 f"http://bücher.test:{receiver.port}/hooks")
            session.flush()
            endpoint_id = endpoint.id
        end(pg_jobs, batch_id)
        assert deliver_due(pg_jobs.sessions, named) == 1
    assert receiver.received[0].headers["host"] == f"xn--bcher-kva.test:{receiver.port}"
    with session_scope(pg_jobs.sessions) as session:
        endpoints.delete_endpoint(session, endpoint_id)

"""Webhooks go to public addresses only, unless the deployment allows more: checked at registration
and again at each delivery, which posts to the address it checked (a name re-pointed at a private
address since registration gets no POST). The suite's settings allow private addresses (its
receivers are on 127.0.0.1); these tests turn that off. The resolver is replaced for made-up names
only; every POST that is expected goes to a real receiver."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from sqlalchemy import select

from batchapi.batches import states
from batchapi.batches.states import BatchStatus
from batchapi.db.models import Batch, WebhookDelivery, WebhookEndpoint
from batchapi.db.session import session_scope
from batchapi.webhooks import endpoints
from batchapi.webhooks.addresses import ForbiddenAddress, address_class, check_host
from batchapi.webhooks.delivery import deliver_due
from tests.utils.job_rows import make_batch
from tests.webhooks.receiver import Receiver

NAME = "hooks.rebound.test"  # a name only the fake resolver knows


@pytest.fixture
def strict(pg_jobs):
    """The deployed default: no private addresses."""
    return pg_jobs.settings.model_copy(update={"webhook_allow_private": False, "webhook_retry_seconds": 1.0})


@pytest.fixture
def rebound(monkeypatch):
    """``NAME`` resolves to 127.0.0.1; every other name as the real resolver says."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host == NAME:
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("address,kind", [
    ("127.0.0.1", "loopback"), ("10.0.0.5", "private"), ("192.168.1.1", "private"), ("172.16.0.1", "private"),
    ("169.254.169.254", "link-local"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"),
    ("240.0.0.1", "reserved"), ("100.64.0.1", "non-public"), ("::1", "loopback"), ("::", "unspecified"),
    ("fc00::1", "private"), ("fd12:3456::1", "private"), ("fe80::1", "link-local"), ("ff02::1", "multicast"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"), ("2002:a00:1::", "private"),
    ("93.184.215.14", None), ("8.8.8.8", None), ("2606:4700:4700::1111", None),
])
def test_address_classes(address, kind):
    assert address_class(ipaddress.ip_address(address)) == kind


def test_allowed_hosts_and_networks_pass(strict):
    allowing = strict.model_copy(update={"webhook_allowed_hosts": ["localhost", "10.1.0.0/16", "fd00::/8"]})
    assert check_host(allowing, "LOCALHOST", 80) is None  # a named host is not checked at all
    assert check_host(allowing, "10.1.2.3", 80) == [ipaddress.ip_address("10.1.2.3")]
    assert check_host(allowing, "fd00::5", 80) == [ipaddress.ip_address("fd00::5")]
    for refused in ("10.2.0.1", "127.0.0.1", "fc00::1"):
        with pytest.raises(ForbiddenAddress):
            check_host(allowing, refused, 80)
    assert check_host(strict, "93.184.215.14", 443) == [ipaddress.ip_address("93.184.215.14")]


def test_a_name_resolving_to_a_private_address_is_refused(strict, rebound):
    with pytest.raises(ForbiddenAddress) as refused:
        check_host(strict, NAME, 80)
    assert refused.value.message.startswith(f"webhook URL refused: {NAME} resolves to 127.0.0.1, which is not "
                                            "a public address (loopback)")
    assert refused.value.param == "url" and refused.value.code == "webhook_url_forbidden"


@pytest.fixture
def ended(pg_jobs):
    """``ended(settings, url)``: a batch ended with an endpoint at ``url`` registered under
    ``settings``; its id. The endpoints go afterwards, so no later test's sweep posts to them."""
    made = []

    def ended(registering, url: str) -> str:
        batch_id, _ = make_batch(pg_jobs, 0)
        with session_scope(pg_jobs.sessions) as session:
            project_id = session.get(Batch, batch_id).project_id
            made.append(endpoints.create_endpoint(session, registering, project_id, url).id)
        with session_scope(pg_jobs.sessions) as session:
            assert states.transition(session, batch_id, BatchStatus.EXPIRED)
        return batch_id

    yield ended
    with session_scope(pg_jobs.sessions) as session:
        for endpoint_id in made:
            endpoints.delete_endpoint(session, endpoint_id)


def _delivery(ctx, batch_id: str) -> WebhookDelivery:
    with ctx.sessions() as session:
        return session.scalars(select(WebhookDelivery).where(WebhookDelivery.batch_id == batch_id)).one()


def test_a_host_rebound_to_loopback_after_registration_gets_no_post(pg_jobs, strict, ended, rebound):
    with Receiver() as receiver:  # the address the name now leads to: it must hear nothing
        batch_id = ended(pg_jobs.settings, f"http://{NAME}:{receiver.port}/hooks")
        assert deliver_due(pg_jobs.sessions, strict) == 0
        assert receiver.received == []
    row = _delivery(pg_jobs, batch_id)
    assert (row.status, row.attempts, row.last_status_code) == ("pending", 1, None)  # retried like any failure
    assert row.last_error.startswith(f"ForbiddenAddress: webhook URL refused: {NAME} resolves to 127.0.0.1")


def test_a_literal_private_endpoint_gets_no_post_once_private_is_refused(pg_jobs, strict, ended):
    with Receiver() as receiver:
        batch_id = ended(pg_jobs.settings, receiver.url)
        assert deliver_due(pg_jobs.sessions, strict) == 0
        assert receiver.received == []
    assert "127.0.0.1 is not a public address (loopback)" in _delivery(pg_jobs, batch_id).last_error


def test_an_allowed_network_is_posted_to_at_the_address_checked(pg_jobs, strict, ended, rebound):
    allowing = strict.model_copy(update={"webhook_allowed_hosts": ["127.0.0.0/8"]})
    with Receiver() as receiver:
        url = f"http://{NAME}:{receiver.port}/hooks"
        batch_id = ended(allowing, url)
        assert deliver_due(pg_jobs.sessions, allowing) == 1
        [got] = receiver.received
    assert got.headers["host"] == f"{NAME}:{receiver.port}"  # sent to the pinned address, named as registered
    assert _delivery(pg_jobs, batch_id).status == "delivered"


def test_an_allowed_host_name_is_posted_to(pg_jobs, strict, ended):
    allowing = strict.model_copy(update={"webhook_allowed_hosts": ["localhost"]})
    with Receiver() as receiver:
        url = f"http://localhost:{receiver.port}/hooks"
        with pytest.raises(ForbiddenAddress):
            ended(strict, url)
        batch_id = ended(allowing, url)
        assert deliver_due(pg_jobs.sessions, allowing) == 1
        assert len(receiver.received) == 1
    assert _delivery(pg_jobs, batch_id).status == "delivered"


def test_a_host_that_stops_resolving_gets_no_post(pg_jobs, strict, ended, monkeypatch):
    batch_id = ended(pg_jobs.settings, "http://127.0.0.1:9/hooks")  # never posted to: re-pointed first
    with session_scope(pg_jobs.sessions) as session:  # re-pointed at a name that resolves to nothing
        session.get(WebhookEndpoint, _delivery(pg_jobs, batch_id).endpoint_id).url = "http://gone.invalid/hooks"
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == "gone.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert deliver_due(pg_jobs.sessions, strict) == 0
    row = _delivery(pg_jobs, batch_id)
    assert (row.attempts, row.last_error) == (1, "HostUnresolved: gone.invalid does not resolve")

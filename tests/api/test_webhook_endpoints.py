"""The webhook endpoints API with the openai SDK's ``client.webhooks`` (create, retrieve, list,
update, rotate_secret, test, delete) against the live server on PostgreSQL, a real receiver, and
the deliveries listing (batchapi's extension)."""

from __future__ import annotations

import io
import re

import httpx
import openai
import pytest

from batchapi.batches.sweeper import sweep
from batchapi.webhooks.delivery import deliver_due
from tests.utils.batch_service import jsonl, new_key, request_line
from tests.utils.waiting import wait_for_batch, wait_until
from tests.webhooks.receiver import Receiver


def test_create_retrieve_list_update_rotate_test_delete(client, pg_server):
    with Receiver() as receiver:
        created = client.webhooks.create(url=receiver.url, event_types=["batch.completed"], name="nightly")
        assert created.object == "webhook_endpoint" and created.signing_secret.startswith("whsec_")
        assert (created.url, created.event_types, created.name) == (receiver.url, ["batch.completed"], "nightly")
        assert created.signing_secret_hint and created.signing_secret not in created.signing_secret_hint
        got = client.webhooks.retrieve(created.id)
        assert got.id == created.id and "signing_secret" not in got.model_dump()
        second = client.webhooks.create(url=receiver.url + "/2", event_types=["batch.failed", "batch.expired"],
                                        name="second")
        assert [e.id for e in client.webhooks.list()] == [second.id, created.id]
        page = client.webhooks.list(limit=1)
        assert [e.id for e in page.data] == [second.id] and page.has_more

        updated = client.webhooks.update(created.id, event_types=["batch.completed", "batch.cancelled"])
        assert updated.event_types == ["batch.completed", "batch.cancelled"] and updated.url == receiver.url
        rotated = client.webhooks.rotate_secret(created.id, keep_old_secret_active_for_24_hours=True)
        assert rotated.signing_secret != created.signing_secret

        result = client.webhooks.test(created.id, event_type="batch.cancelled")
        assert (result.object, result.status_code, result.success) == ("webhook_endpoint.test", 200, True)
        [sample] = receiver.received
        for secret in (created.signing_secret, rotated.signing_secret):  # the old one still signs for a day
            assert client.webhooks.unwrap(sample.body, sample.headers, secret=secret).type == "batch.cancelled"

        deleted = client.webhooks.delete(second.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (second.id, True, "webhook_endpoint.deleted")
        with pytest.raises(openai.NotFoundError):
            client.webhooks.retrieve(second.id)

    other = openai.OpenAI(base_url=pg_server.base_url + "/v1", api_key=new_key(pg_server, "webhooks-other"),
                          max_retries=0)
    with pytest.raises(openai.NotFoundError):  # another project's endpoint looks like none
        other.webhooks.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        other.webhooks.delete(created.id)


@pytest.mark.parametrize("change,param", [({"url": "ftp://x.test/"}, "url"),
                                          ({"event_types": ["response.completed"]}, "event_types")])
def test_bad_endpoints_are_refused(client, change, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.webhooks.create(**{"url": "http://127.0.0.1:9/", "event_types": ["batch.completed"], "name": "x",
                                  **change})
    assert refused.value.response.json()["error"]["param"] == param


def test_deliveries_show_what_was_sent(client, pg_server, api_key, model_id):
    with Receiver(statuses=[500]) as receiver:
        endpoint = client.webhooks.create(url=receiver.url, event_types=["batch.cancelled"], name="c")
        f = client.files.create(file=("b.jsonl", io.BytesIO(jsonl([request_line("a", model_id)]))), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for_batch(client, batch.id, {"in_progress"}, timeout=30)
        client.batches.cancel(batch.id)
        wait_until(lambda: sweep(pg_server.ctx) and client.batches.retrieve(batch.id).status == "cancelled")
        url = f"{pg_server.base_url}/v1/webhook_endpoints/{endpoint.id}/deliveries"
        headers = {"Authorization": f"Bearer {api_key}"}

        def listed():
            return httpx.get(url, headers=headers, params={"batch_id": batch.id}).json()["data"]

        [first] = listed()
        assert first["event_type"] == "batch.cancelled" and first["batch_id"] == batch.id
        if first["status"] == "pending" and first["attempts"] == 0:  # the sweep above may have sent it already
            deliver_due(pg_server.ctx.sessions, pg_server.ctx.settings)
        [failed_once] = listed()
        assert (failed_once["status"], failed_once["attempts"], failed_once["last_status_code"]) == ("pending", 1, 500)
        assert failed_once["next_attempt_at"] >= failed_once["last_attempt_at"]
    assert httpx.get(f"{pg_server.base_url}/v1/webhook_endpoints/we_nope/deliveries", headers=headers).status_code == 404


@pytest.fixture
def strict(pg_server, monkeypatch):
    """The live server as deployed: private webhook addresses refused (the suite's settings allow
    them, for its receivers on 127.0.0.1)."""
    ctx = pg_server.ctx
    monkeypatch.setattr(ctx, "settings", ctx.settings.model_copy(update={"webhook_allow_private": False}))


@pytest.mark.parametrize("url,refused", [
    ("http://127.0.0.1:8080/hooks", "127.0.0.1 is not a public address (loopback)"),
    ("http://10.0.0.5/hooks", "10.0.0.5 is not a public address (private)"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is not a public address (link-local)"),
    ("https://[::1]:8443/hooks", "::1 is not a public address (loopback)"),
    ("http://[::ffff:10.0.0.5]/hooks", "::ffff:10.0.0.5 is not a public address (private)"),
    # 127.0.0.1 or ::1, as /etc/hosts has it
    ("http://localhost:8080/hooks", r"localhost resolves to [0-9a-f.:]+, which is not a public address \(loopback\)"),
])
def test_private_endpoints_are_refused(client, strict, url, refused):
    with pytest.raises(openai.BadRequestError) as error:
        client.webhooks.create(url=url, event_types=["batch.completed"], name="inside")
    body = error.value.response.json()["error"]
    assert (body["param"], body["code"], body["type"]) == ("url", "webhook_url_forbidden", "invalid_request_error")
    assert re.match(re.escape("webhook URL refused: ") + (refused if "resolves" in refused else re.escape(refused)),
                    body["message"])
    assert list(client.webhooks.list()) == []


def test_an_allowed_endpoint_is_taken_and_cannot_be_moved_inside(client, pg_server, strict, monkeypatch):
    """An address the deployment allows is taken as a public one is (check_host's own test covers
    public addresses; no test registers one); a move to any other private address is refused."""
    ctx = pg_server.ctx
    monkeypatch.setattr(ctx, "settings", ctx.settings.model_copy(update={"webhook_allowed_hosts": ["127.0.0.1/32"]}))
    created = client.webhooks.create(url="http://127.0.0.1:9/hooks", event_types=["batch.completed"],
                                     name="allowed")
    assert created.url == "http://127.0.0.1:9/hooks"
    with pytest.raises(openai.BadRequestError) as error:
        client.webhooks.update(created.id, url="http://192.168.0.10/hooks")
    assert error.value.response.json()["error"]["code"] == "webhook_url_forbidden"
    assert client.webhooks.retrieve(created.id).url == "http://127.0.0.1:9/hooks"


def test_a_test_event_is_not_sent_to_an_endpoint_now_refused(client, pg_server, monkeypatch):
    with Receiver() as receiver:
        created = client.webhooks.create(url=receiver.url, event_types=["batch.completed"], name="local")
        ctx = pg_server.ctx
        monkeypatch.setattr(ctx, "settings", ctx.settings.model_copy(update={"webhook_allow_private": False}))
        with pytest.raises(openai.BadRequestError) as error:
            client.webhooks.test(created.id, event_type="batch.completed")
        assert receiver.received == []
    assert error.value.response.json()["error"]["code"] == "webhook_url_forbidden"

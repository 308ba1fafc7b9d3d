"""OpenAI's webhook endpoints API (``/v1/webhook_endpoints``, as the openai SDK's ``client.webhooks``
calls it), and batchapi's ``GET /v1/webhook_endpoints/{id}/deliveries``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, TypeVar

from fastapi import APIRouter, Query
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from batchapi.api.deps import ContextDep, ProjectDep
from batchapi.api.schemas import error_responses
from batchapi.api.webhook_schemas import (
    CreateWebhookEndpointRequest,
    RotateSecretRequest,
    TestWebhookRequest,
    UpdateWebhookEndpointRequest,
    WebhookDeliveryList,
    WebhookDeliveryObject,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
    WebhookTestResult,
)
from batchapi.context import Context
from batchapi.db.models import WebhookEndpoint
from batchapi.db.session import session_scope
from batchapi.errors import InvalidRequest, RateLimited
from batchapi.webhooks import delivery, endpoints, outbox

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["webhooks"], responses=error_responses(400, 401, 431))
T = TypeVar("T")
TESTS_PER_PROJECT = 4  # webhook tests in flight at once, per project and API process
_tests_running: Counter[str] = Counter()  # per project; touched on the event loop only


def _committed(ctx: Context, act: Callable[[Session], T]) -> T:
    with session_scope(ctx.sessions) as session:
        result = act(session)
        session.flush()
        return result


@router.post("")
def create_endpoint(ctx: ContextDep, project_id: ProjectDep, body: CreateWebhookEndpointRequest) -> WebhookEndpointWithSecret:
    return WebhookEndpointWithSecret.of(_committed(ctx, lambda s: endpoints.create_endpoint(
        s, ctx.settings, project_id, body.url, body.event_types, body.name)))


@router.get("")
def list_endpoints(ctx: ContextDep, project_id: ProjectDep, after: str | None = None,
                   limit: Annotated[int, Query(ge=1, le=100)] = 20) -> WebhookEndpointList:
    with ctx.sessions() as session:
        rows, has_more = endpoints.page_endpoints(session, project_id, limit, after)
        return WebhookEndpointList.of([WebhookEndpointObject.of(r) for r in rows], has_more)


@router.get("/{webhook_endpoint_id}", responses=error_responses(404))
def retrieve_endpoint(ctx: ContextDep, project_id: ProjectDep, webhook_endpoint_id: str) -> WebhookEndpointObject:
    with ctx.sessions() as session:
        return WebhookEndpointObject.of(endpoints.get_endpoint(session, webhook_endpoint_id, project_id))


@router.post("/{webhook_endpoint_id}", responses=error_responses(404))
def update_endpoint(ctx: ContextDep, project_id: ProjectDep, webhook_endpoint_id: str,
                    body: UpdateWebhookEndpointRequest) -> WebhookEndpointObject:
    return WebhookEndpointObject.of(_committed(ctx, lambda s: endpoints.update_endpoint(
        s, ctx.settings, webhook_endpoint_id, project_id, body.url, body.event_types, body.name)))


@router.delete("/{webhook_endpoint_id}", responses=error_responses(404))
def delete_endpoint(ctx: ContextDep, project_id: ProjectDep, webhook_endpoint_id: str) -> WebhookEndpointDeleted:
    _committed(ctx, lambda s: endpoints.delete_endpoint(s, webhook_endpoint_id, project_id))
    return WebhookEndpointDeleted(id=webhook_endpoint_id)


@router.post("/{webhook_endpoint_id}/rotate_secret", responses=error_responses(404))
def rotate_secret(ctx: ContextDep, project_id: ProjectDep, webhook_endpoint_id: str,
                  body: RotateSecretRequest | None = None) -> WebhookEndpointWithSecret:
    keep = body.keep_old_secret_active_for_24_hours if body else False
    return WebhookEndpointWithSecret.of(_committed(ctx, lambda s: endpoints.rotate_secret(
        s, webhook_endpoint_id, keep, project_id)))


@router.post("/{webhook_endpoint_id}/test", responses=error_responses(404, 429))
async def test_endpoint(ctx: ContextDep, project_id: ProjectDep, webhook_endpoint_id: str,
                        body: TestWebhookRequest) -> WebhookTestResult:
    """Sends a sample event now, signed as a real one; its answer's status comes back, and
    ``success`` says whether it was a 2xx (a redirect is not followed). Async, so a receiver that never answers holds
    none of the API's threads; a project has at most ``TESTS_PER_PROJECT`` in flight in a process."""
    event_type = endpoints.check_event_types([body.event_type])[0]
    with _test_slot(project_id):
        endpoint = await run_in_threadpool(_endpoint, ctx, webhook_endpoint_id, project_id)
        outcome = await delivery.send_test(ctx.settings, endpoint, event_type)
    if outcome.status_code is None:
        raise InvalidRequest(f"the endpoint did not answer: {outcome.error}", "url", "webhook_endpoint_unreachable")
    return WebhookTestResult(webhook_endpoint_id=endpoint.id, event_type=event_type, status_code=outcome.status_code,
                             success=outcome.ok)


def _endpoint(ctx: Context, webhook_endpoint_id: str, project_id: str) -> WebhookEndpoint:
    with ctx.sessions() as session:
        return endpoints.get_endpoint(session, webhook_endpoint_id, project_id)


@contextmanager
def _test_slot(project_id: str) -> Iterator[None]:
    """One of the project's test slots, for as long as its test runs (all on the event loop: no lock)."""
    if _tests_running[project_id] >= TESTS_PER_PROJECT:
        raise RateLimited(f"This project already has {TESTS_PER_PROJECT} webhook tests in flight; try again when "
                          "one has ended.")
    _tests_running[project_id] += 1
    try:
        yield
    finally:
        _tests_running[project_id] -= 1
        if not _tests_running[project_id]:
            del _tests_running[project_id]


@router.get("/{webhook_endpoint_id}/deliveries", responses=error_responses(404))
def list_deliveries(ctx: ContextDep, project_id: ProjectDep, webhook_endpoint_id: str, batch_id: str | None = None,
                    limit: Annotated[int, Query(ge=1, le=100)] = 20) -> WebhookDeliveryList:
    """Extension: the endpoint's events, newest first: status, attempts, last status code and error."""
    with ctx.sessions() as session:
        endpoints.get_endpoint(session, webhook_endpoint_id, project_id)
        rows = outbox.list_deliveries(session, project_id, batch_id, limit, webhook_endpoint_id)
        return WebhookDeliveryList(data=[WebhookDeliveryObject.of(r) for r in rows])

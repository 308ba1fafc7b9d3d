"""The outbox: a batch's final event, one row per subscribed endpoint, added in the transaction
that moves the batch to its final status (``enqueue``), so an event exists exactly when the end
is committed, and sending it (``delivery``) never holds that transaction up."""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchapi.db.clock import now
from batchapi.db.ids import new_id
from batchapi.db.models import WebhookDelivery, WebhookEndpoint
from batchapi.webhooks.events import event_body


class DeliveryStatus(StrEnum):
    PENDING = "pending"  # not sent yet, or to be sent again at ``next_attempt_at``
    DELIVERED = "delivered"  # the endpoint answered 2xx
    FAILED = "failed"  # no 2xx within ``webhook_max_age_seconds``: given up


def enqueue(session: Session, project_id: str, batch_id: str, event_type: str) -> list[str]:
    """Add the event for every endpoint of the project that subscribes to it (the caller owns
    the transaction); the delivery ids."""
    endpoints = session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id)).all()
    wanted = [e for e in endpoints if event_type in e.event_types]
    if not wanted:
        return []
    t = now()
    event_id = new_id("evt_")
    payload = event_body(event_id, event_type, t, batch_id)
    rows = [
        WebhookDelivery(
            id=new_id("whdel_"), event_id=event_id, endpoint_id=endpoint.id, project_id=project_id,
            batch_id=batch_id, event_type=event_type, payload=payload, status=DeliveryStatus.PENDING, attempts=0,
            next_attempt_at=t, created_at=t,
        )
        for endpoint in wanted
    ]
    session.add_all(rows)
    return [row.id for row in rows]


def list_deliveries(session: Session, project_id: str | None = None, batch_id: str | None = None,
                    limit: int = 100, endpoint_id: str | None = None) -> list[WebhookDelivery]:
    """Newest first."""
    query = select(WebhookDelivery).order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
    for column, value in ((WebhookDelivery.project_id, project_id), (WebhookDelivery.batch_id, batch_id),
                          (WebhookDelivery.endpoint_id, endpoint_id)):
        if value is not None:
            query = query.where(column == value)
    return list(session.scalars(query.limit(limit)))

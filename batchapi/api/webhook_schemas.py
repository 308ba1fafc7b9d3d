"""Request and response bodies of the webhook endpoints API, in the shapes of OpenAI's
(``client.webhooks.create``, ``list``, ``retrieve``, ``update``, ``delete``, ``rotate_secret``, ``test``
of the openai SDK); the deliveries listing is batchapi's own."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from batchapi.api.schemas import _Page
from batchapi.db.models import WebhookDelivery, WebhookEndpoint
from batchapi.webhooks.signing import hint


class CreateWebhookEndpointRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str
    event_types: list[str] | None = None  # default: every batch event
    name: str | None = None


class UpdateWebhookEndpointRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str | None = None
    event_types: list[str] | None = None
    name: str | None = None


class RotateSecretRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    keep_old_secret_active_for_24_hours: bool = False


class TestWebhookRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    event_type: str = "batch.completed"


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    updated_at: int
    event_types: list[str]
    name: str
    url: str
    signing_secret_hint: str

    @classmethod
    def of(cls, row: WebhookEndpoint) -> WebhookEndpointObject:
        return cls(id=row.id, created_at=row.created_at, updated_at=row.updated_at, event_types=row.event_types,
                   name=row.name, url=row.url, signing_secret_hint=hint(row.secret))


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """Only on create and rotate: the signing secret, shown once."""

    signing_secret: str

    @classmethod
    def of(cls, row: WebhookEndpoint) -> WebhookEndpointWithSecret:
        return cls(**WebhookEndpointObject.of(row).model_dump(exclude={"object"}), signing_secret=row.secret)


class WebhookEndpointList(_Page, BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookEndpointObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookTestResult(BaseModel):
    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    # whether the receiver accepted the event (a 2xx), as a delivery counts it; OpenAI's always says
    # true (the test ran), which tells nothing a receiver answering 302 or 500 needs to know
    success: bool


class WebhookDeliveryObject(BaseModel):
    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    event_id: str
    event_type: str
    batch_id: str
    webhook_endpoint_id: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None
    last_error: str | None
    created_at: int
    last_attempt_at: int | None
    next_attempt_at: int | None  # of a pending one
    delivered_at: int | None

    @classmethod
    def of(cls, d: WebhookDelivery) -> WebhookDeliveryObject:
        return cls(id=d.id, event_id=d.event_id, event_type=d.event_type, batch_id=d.batch_id,
                   webhook_endpoint_id=d.endpoint_id, status=d.status, attempts=d.attempts,
                   last_status_code=d.last_status_code, last_error=d.last_error, created_at=d.created_at,
                   last_attempt_at=d.last_attempt_at, next_attempt_at=d.next_attempt_at if d.status == "pending" else None,
                   delivered_at=d.delivered_at)


class WebhookDeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookDeliveryObject]

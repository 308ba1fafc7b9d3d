"""The events a batch sends when it ends, in the shape of OpenAI's (``BatchCompletedWebhookEvent``
and its siblings in the openai SDK): ``{"id": "evt_…", "object": "event", "created_at", "type",
"data": {"id"}}``."""

from __future__ import annotations

import json

# OpenAI's event type for each final status of a batch is ``batch.<status>``
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")


def event_type_of(status: str) -> str:
    event_type = f"batch.{status}"
    assert event_type in EVENT_TYPES, f"a batch that ends {status!r} sends no event"
    return event_type


def event_body(event_id: str, event_type: str, created_at: int, batch_id: str) -> str:
    """The exact JSON body every attempt sends (and signs)."""
    return json.dumps({"id": event_id, "object": "event", "created_at": created_at, "type": event_type,
                       "data": {"id": batch_id}}, separators=(",", ":"))

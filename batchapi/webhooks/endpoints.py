"""A project's webhook endpoints: create (the secret is shown once), list, update, delete, rotate;
for the CLI (any project) and the API (``project_id`` given: another project's look like none)."""

from __future__ import annotations

from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchapi.config import Settings
from batchapi.db.clock import now
from batchapi.db.ids import new_id
from batchapi.db.models import WebhookEndpoint
from batchapi.db.paging import page
from batchapi.errors import InvalidRequest, NotFound
from batchapi.webhooks.addresses import check_host, default_port
from batchapi.webhooks.events import EVENT_TYPES
from batchapi.webhooks.signing import new_secret

MAX_URL = 2048
ROTATION_GRACE_SECONDS = 24 * 3600  # a rotated-out secret still signs this long when asked to


def check_url(settings: Settings, url: str) -> str:
    """``url``, if it is http(s) and its host may be posted to (``addresses``); a name that does not
    resolve yet is taken, as each delivery checks again."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or len(url) > MAX_URL:
        raise InvalidRequest(f"{url!r} is not an http(s) URL of at most {MAX_URL} characters", "url")
    check_host(settings, parts.hostname, port or default_port(parts.scheme))
    return url


def check_event_types(event_types: list[str] | None) -> list[str]:
    if not event_types:
        return list(EVENT_TYPES)
    unknown = sorted(set(event_types) - set(EVENT_TYPES))
    if unknown:
        raise InvalidRequest(f"unknown event types {unknown}; expected some of {list(EVENT_TYPES)}", "event_types")
    return [t for t in EVENT_TYPES if t in event_types]


def create_endpoint(session: Session, settings: Settings, project_id: str, url: str,
                    event_types: list[str] | None = None, name: str | None = None) -> WebhookEndpoint:
    """A new endpoint; its ``secret`` is the signing secret, to hand to the receiver once."""
    t = now()
    endpoint = WebhookEndpoint(
        id=new_id("we_"), project_id=project_id, name=(name or urlsplit(url).hostname or "")[:200],
        url=check_url(settings, url), event_types=check_event_types(event_types), secret=new_secret(), created_at=t,
        updated_at=t,
    )
    session.add(endpoint)
    return endpoint


def list_endpoints(session: Session, project_id: str | None = None) -> list[WebhookEndpoint]:
    query = select(WebhookEndpoint).order_by(WebhookEndpoint.created_at, WebhookEndpoint.id)
    if project_id is not None:
        query = query.where(WebhookEndpoint.project_id == project_id)
    return list(session.scalars(query))


def page_endpoints(session: Session, project_id: str, limit: int, after: str | None) -> tuple[list, bool]:
    """Newest first, after the endpoint ``after``; and whether more follow."""
    cursor = get_endpoint(session, after, project_id) if after else None
    query = select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id)
    return page(session, query, WebhookEndpoint, cursor, limit, newest_first=True)


def get_endpoint(session: Session, endpoint_id: str, project_id: str | None = None) -> WebhookEndpoint:
    endpoint = session.get(WebhookEndpoint, endpoint_id)
    if endpoint is None or project_id not in (None, endpoint.project_id):
        raise NotFound(f"No such webhook endpoint: {endpoint_id}", "webhook_endpoint_id")
    return endpoint


def update_endpoint(session: Session, settings: Settings, endpoint_id: str, project_id: str,
                    url: str | None = None, event_types: list[str] | None = None,
                    name: str | None = None) -> WebhookEndpoint:
    """Change what is given; the rest stays."""
    endpoint = get_endpoint(session, endpoint_id, project_id)
    if url is not None:
        endpoint.url = check_url(settings, url)
    if event_types is not None:
        endpoint.event_types = check_event_types(event_types)
    if name is not None:
        endpoint.name = name[:200]
    endpoint.updated_at = now()
    return endpoint


def delete_endpoint(session: Session, endpoint_id: str, project_id: str | None = None) -> None:
    """Remove the endpoint and its deliveries, sent or not."""
    session.delete(get_endpoint(session, endpoint_id, project_id))


def rotate_secret(session: Session, endpoint_id: str, keep_old: bool = False,
                  project_id: str | None = None) -> WebhookEndpoint:
    """A new signing secret; with ``keep_old`` the previous one signs too for a day, so receivers
    can switch without missing an event (the SDK accepts any of the signatures sent)."""
    endpoint = get_endpoint(session, endpoint_id, project_id)
    t = now()
    endpoint.previous_secret = endpoint.secret if keep_old else None
    endpoint.previous_secret_expires_at = t + ROTATION_GRACE_SECONDS if keep_old else None
    endpoint.secret = new_secret()
    endpoint.updated_at = t
    return endpoint


def signing_secrets(endpoint: WebhookEndpoint, t: int) -> list[str]:
    """The secrets that sign a delivery at ``t``: the current one, and a rotated-out one in its grace."""
    kept = endpoint.previous_secret is not None and (endpoint.previous_secret_expires_at or 0) > t
    return [endpoint.secret, endpoint.previous_secret] if kept else [endpoint.secret]

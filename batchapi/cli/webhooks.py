"""``batchapi webhooks create | list | delete | rotate | deliveries``: a project's webhook endpoints
and what was sent to them, on the database of BATCHAPI_DATABASE_URL (as ``batchapi keys``)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session

from batchapi.config import Settings
from batchapi.db.models import WebhookDelivery, WebhookEndpoint
from batchapi.db.projects import cli_session, project_by_name
from batchapi.webhooks import endpoints, outbox
from batchapi.webhooks.events import EVENT_TYPES
from batchapi.webhooks.signing import hint


def _time(timestamp: int | None) -> str:
    return "" if timestamp is None else datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _endpoint_dict(e: WebhookEndpoint) -> dict:
    return {"id": e.id, "object": "webhook_endpoint", "project_id": e.project_id, "name": e.name, "url": e.url,
            "event_types": e.event_types, "signing_secret_hint": hint(e.secret), "created_at": e.created_at,
            "updated_at": e.updated_at}


def _delivery_dict(d: WebhookDelivery) -> dict:
    return {name: getattr(d, name) for name in (
        "id", "event_id", "endpoint_id", "batch_id", "event_type", "status", "attempts", "last_status_code",
        "last_error", "created_at", "last_attempt_at", "next_attempt_at", "delivered_at")}


def run(args: argparse.Namespace, settings: Settings, console: Console) -> int:
    """One ``batchapi webhooks ACTION`` in one transaction; a refusal (an unknown project or id, a
    URL that may not be posted to) rolls it back and reaches ``batchapi.cli.commands.main``."""
    with cli_session(settings) as session:
        if args.action == "create":  # the one action that needs the settings: which hosts may be posted to
            return _create(args, settings, session, console)
        return ACTIONS[args.action](args, session, console)


def _create(args, settings: Settings, session: Session, console: Console) -> int:
    project = project_by_name(session, args.project)
    endpoint = endpoints.create_endpoint(session, settings, project.id, args.url, args.events, args.name)
    session.flush()
    console.print(f"webhook endpoint {endpoint.id} of project {args.project!r}: {endpoint.url}")
    console.print(f"events: {', '.join(endpoint.event_types)}; signing secret (shown once):")
    print(endpoint.secret)
    return 0


def _list(args, session: Session, console: Console) -> int:
    project_id = project_by_name(session, args.project).id if args.project else None
    rows = endpoints.list_endpoints(session, project_id)
    if args.json:
        print(json.dumps([_endpoint_dict(e) for e in rows], indent=2))
        return 0
    table = Table("id", "url", "events", "secret", "created", box=None, pad_edge=False)
    for e in rows:
        table.add_row(e.id, e.url, ", ".join(e.event_types), hint(e.secret), _time(e.created_at))
    console.print(table)
    return 0


def _delete(args, session: Session, console: Console) -> int:
    endpoints.delete_endpoint(session, args.endpoint_id)
    console.print(f"{args.endpoint_id} deleted")
    return 0


def _rotate(args, session: Session, console: Console) -> int:
    endpoint = endpoints.rotate_secret(session, args.endpoint_id, keep_old=args.keep_old)
    kept = "; the previous secret still signs for 24 hours" if args.keep_old else ""
    console.print(f"new signing secret of {endpoint.id} (shown once){kept}:")
    print(endpoint.secret)
    return 0


def _deliveries(args, session: Session, console: Console) -> int:
    project_id = project_by_name(session, args.project).id if args.project else None
    rows = outbox.list_deliveries(session, project_id, args.batch, args.limit)
    if args.json:
        print(json.dumps([_delivery_dict(d) for d in rows], indent=2))
        return 0
    # fits 80 columns: ids are copied whole, so only the error may wrap (--json has every field)
    table = Table(box=None, pad_edge=False)
    for name in ("batch", "event", "status", "tries", "code", "when"):
        table.add_column(name, no_wrap=True)
    table.add_column("error", overflow="fold")
    for d in rows:
        table.add_row(d.batch_id, d.event_type, d.status, str(d.attempts),
                      "" if d.last_status_code is None else str(d.last_status_code),
                      _time(d.last_attempt_at)[11:], (d.last_error or "")[:120])
    console.print(table)
    return 0


ACTIONS = {"list": _list, "delete": _delete, "rotate": _rotate, "deliveries": _deliveries}


def add_parser(sub, func) -> None:
    """The ``webhooks`` sub-commands; ``func(args)`` runs the chosen one."""
    hooks = sub.add_parser("webhooks", help="webhook endpoints: batch.completed/failed/expired/cancelled events")
    actions = hooks.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="register an endpoint; prints its signing secret last")
    create.add_argument("--project", required=True)
    create.add_argument("--url", required=True, help="receives the signed POSTs (http or https)")
    create.add_argument("--events", nargs="+", choices=EVENT_TYPES, default=None, help="default: all four")
    create.add_argument("--name", default=None, help="default: the URL's host")
    listing = actions.add_parser("list", help="endpoints (never the secrets), oldest first")
    listing.add_argument("--project", default=None)
    listing.add_argument("--json", action="store_true")
    delete = actions.add_parser("delete", help="remove an endpoint and its deliveries")
    delete.add_argument("endpoint_id")
    rotate = actions.add_parser("rotate", help="a new signing secret; prints it last")
    rotate.add_argument("endpoint_id")
    rotate.add_argument("--keep-old", action="store_true", help="the old secret also signs for 24 hours")
    deliveries = actions.add_parser("deliveries", help="events sent or being sent, newest first")
    deliveries.add_argument("--project", default=None)
    deliveries.add_argument("--batch", default=None, help="only this batch's events")
    deliveries.add_argument("--limit", type=int, default=50)
    deliveries.add_argument("--json", action="store_true")
    hooks.set_defaults(func=func)

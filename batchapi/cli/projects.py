"""``batchapi projects list | set | quota``: each project's share of the fleet and its quotas, on
the database of BATCHAPI_DATABASE_URL (as ``batchapi keys``).

A project's weight is its share against other projects' when workers pick the next shard
(``batches.sharing.fair_share``); its quotas limit, per model, the estimated tokens of its unfinished
batches and how many there may be (``batches.sharing.quotas``).
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from sqlalchemy import select
from sqlalchemy.orm import Session

from batchapi.batches.sharing import quotas
from batchapi.config import Settings
from batchapi.db.models import Project
from batchapi.db.projects import cli_session, project_by_name
from batchapi.errors import InvalidRequest


def run(args: argparse.Namespace, settings: Settings, console: Console) -> int:
    with cli_session(settings) as session:
        return ACTIONS[args.action](args, settings, session, console)


def _limit(value: int) -> str:
    return "none" if value == 0 else f"{value:,}"


def _project_dict(settings: Settings, session: Session, project: Project) -> dict:
    return {"id": project.id, "name": project.name, "weight": project.weight, "quotas": [
        {"model": q.model or "*", "enqueued_tokens_limit": q.limits.enqueued_tokens,
         "unfinished_batches_limit": q.limits.unfinished_batches, "enqueued_tokens": q.usage.enqueued_tokens,
         "unfinished_batches": q.usage.unfinished_batches}
        for q in quotas.overview(session, settings, project.id)]}


def _list(args, settings: Settings, session: Session, console: Console) -> int:
    query = select(Project).order_by(Project.name)
    if args.project:
        query = query.where(Project.name == args.project)
    rows = [_project_dict(settings, session, p) for p in session.scalars(query)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table("project", "weight", "model", "enqueued tokens", "unfinished batches", box=None, pad_edge=False)
    for row in rows:
        for i, q in enumerate(row["quotas"]):
            table.add_row(row["name"] if i == 0 else "", str(row["weight"]) if i == 0 else "", q["model"],
                          f"{q['enqueued_tokens']:,} / {_limit(q['enqueued_tokens_limit'])}",
                          f"{q['unfinished_batches']} / {_limit(q['unfinished_batches_limit'])}")
    console.print(table)
    return 0


def _set(args, settings: Settings, session: Session, console: Console) -> int:
    project = project_by_name(session, args.project)
    if args.weight is not None:
        if not 1 <= args.weight <= 1000:
            raise InvalidRequest("--weight must be from 1 to 1000", "weight")
        project.weight = args.weight
    console.print(f"project {project.name!r}: weight {project.weight}")
    return 0


def _quota(args, settings: Settings, session: Session, console: Console) -> int:
    project = project_by_name(session, args.project)
    model = args.model or quotas.EVERY_MODEL
    what = f"project {project.name!r}, {'every model' if not args.model else 'model ' + repr(args.model)}"
    if args.clear:
        quotas.clear_limits(session, project.id, model)
        console.print(f"{what}: the deployment's limits apply")
        return 0
    for name in ("enqueued_tokens", "unfinished_batches"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be 0 (no limit) or more", name)
    quotas.set_limits(session, project.id, model, enqueued_tokens=args.enqueued_tokens,
                      unfinished_batches=args.unfinished_batches)
    session.flush()
    limits = quotas.limits(session, settings, project.id, model)
    console.print(f"{what}: enqueued tokens {_limit(limits.enqueued_tokens)}, unfinished batches "
                  f"{_limit(limits.unfinished_batches)}")
    return 0


ACTIONS = {"list": _list, "set": _set, "quota": _quota}


def add_parser(sub, func) -> None:
    """The ``projects`` sub-commands; ``func(args)`` runs the chosen one."""
    projects = sub.add_parser("projects", help="each project's share of the fleet and its quotas")
    actions = projects.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="projects with their weight, quotas and what they have enqueued")
    listing.add_argument("--project", default=None, help="only this project")
    listing.add_argument("--json", action="store_true")
    change = actions.add_parser("set", help="a project's weight: its share of the fleet against the others'")
    change.add_argument("project")
    change.add_argument("--weight", type=int, default=None, help="1 to 1000 (default of every project: 1)")
    quota = actions.add_parser("quota", help="a project's limits for a model (0: none), checked as a batch starts")
    quota.add_argument("project")
    quota.add_argument("--model", default=None, help="the served model id (default: every model without its own)")
    quota.add_argument("--enqueued-tokens", type=int, default=None,
                       help="estimated tokens (prompts and max_tokens) of its unfinished batches")
    quota.add_argument("--unfinished-batches", type=int, default=None, help="batches started and not ended")
    quota.add_argument("--clear", action="store_true", help="drop the project's own limits for the model")
    projects.set_defaults(func=func)

"""Projects and their API keys. Only a SHA-256 of each key is stored; the key is shown once."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchapi.config import Settings
from batchapi.db.clock import now
from batchapi.db.ids import new_id
from batchapi.db.models import ApiKey, DashboardSession, Project
from batchapi.db.session import make_engine, make_sessionmaker, session_scope
from batchapi.errors import NotFound, Unauthenticated

KEY_PREFIX = "sk-batch-"
DEFAULT_PROJECT = "default"  # owns everything when auth is off (the embedded default)


@dataclass(frozen=True)
class KeyInfo:
    """What may be shown about a key: never the secret or its hash."""

    id: str
    project: str
    prefix: str
    created_at: int
    revoked_at: int | None
    admin: bool = False


@dataclass(frozen=True)
class Identity:
    """Who a request's key is: its project, and whether it may read every project's reports."""

    key_id: str
    project_id: str
    admin: bool


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_project(session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is not None:
        return project
    project = Project(id=new_id("proj_"), name=name, created_at=now())
    try:
        with session.begin_nested():
            session.add(project)
    except IntegrityError:  # created by someone else meanwhile
        project = session.scalar(select(Project).where(Project.name == name))
    return project


def project_by_name(session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        raise NotFound(f"no project named {name!r} (`batchapi keys create --project {name}` makes one)", "project")
    return project


def create_api_key(session: Session, project_name: str, admin: bool = False) -> str:
    """Add a key to ``project_name`` (created if new) and return the key itself; an ``admin`` key
    also reads every project's usage and costs."""
    project = get_or_create_project(session, project_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(id=new_id("key_"), project_id=project.id, key_hash=hash_key(key), prefix=key[:12],
                       created_at=now(), admin=admin))
    return key


def authenticate(session: Session, key: str | None) -> str:
    """The project id ``key`` belongs to; ``Unauthenticated`` for a missing, unknown or revoked key."""
    return identify(session, key).project_id


def identify(session: Session, key: str | None) -> Identity:
    """As ``authenticate``, with the key's id and admin flag."""
    if not key:
        raise Unauthenticated(
            "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    found = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))
    if found is None:
        shown = key[:8] + "…" if len(key) > 8 else "…"
        raise Unauthenticated(f"Incorrect API key provided: {shown}.")
    return Identity(found.id, found.project_id, found.admin)


class KeyCache:
    """Key hash -> project id for ``seconds`` after a successful lookup, so that polling costs no
    key query. A revoked key is thus refused at most ``seconds`` after its revocation commits (in
    each API process); unknown and revoked keys are never cached. 0 turns the cache off. Not
    locked: it is used from the event loop's thread only."""

    MAX_ENTRIES = 10_000  # cleared when full: a flood of distinct keys cannot grow it

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = seconds, clock
        self._entries: dict[str, tuple[str, float]] = {}

    def get(self, key: str) -> str | None:
        entry = self._entries.get(hash_key(key))
        if entry is None or entry[1] <= self.clock():
            return None
        return entry[0]

    def put(self, key: str, project_id: str) -> None:
        if self.seconds <= 0:
            return
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries.clear()
        self._entries[hash_key(key)] = (project_id, self.clock() + self.seconds)


def list_api_keys(session: Session, project_name: str | None = None) -> list[KeyInfo]:
    """All keys, oldest first, or those of ``project_name`` (none if there is no such project)."""
    query = select(ApiKey, Project.name).join(Project, ApiKey.project_id == Project.id)
    if project_name is not None:
        query = query.where(Project.name == project_name)
    rows = session.execute(query.order_by(ApiKey.created_at, ApiKey.id))
    return [KeyInfo(key.id, name, key.prefix, key.created_at, key.revoked_at, key.admin) for key, name in rows]


def revoke_api_key(session: Session, key_id: str) -> bool:
    """Refuse ``key_id`` from now on; False if it was revoked already, ``NotFound`` if unknown."""
    key = session.get(ApiKey, key_id)
    if key is None:
        raise NotFound(f"No such API key: {key_id}", "key_id")
    if key.revoked_at is not None:
        return False
    key.revoked_at = now()
    return True


@contextmanager
def cli_session(settings: Settings) -> Iterator[Session]:
    """A committed session on an engine of its own, for the one-shot CLI commands."""
    engine = make_engine(settings)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            yield session
    finally:
        engine.dispose()


def create_key(settings: Settings, project_name: str, admin: bool = False) -> str:
    """For ``batchapi keys create --project NAME [--admin]``: a new key, committed (run migrations first)."""
    with cli_session(settings) as session:
        return create_api_key(session, project_name, admin)


def list_keys(settings: Settings, project_name: str | None = None) -> list[KeyInfo]:
    """For ``batchapi keys list [--project NAME]``."""
    with cli_session(settings) as session:
        return list_api_keys(session, project_name)


def revoke_key(settings: Settings, key_id: str) -> bool:
    """For ``batchapi keys revoke KEY_ID``: committed; see ``revoke_api_key``."""
    with cli_session(settings) as session:
        return revoke_api_key(session, key_id)


# dashboard sign-ins: the browser keeps a random token in an HttpOnly cookie, never the key


def open_dashboard_session(session: Session, key: str | None, seconds: float) -> tuple[str, Identity]:
    """Sign in with ``key`` (``Unauthenticated`` if it is not a live key): a new session token."""
    identity = identify(session, key)
    token = secrets.token_urlsafe(32)
    t = now()
    session.add(DashboardSession(token_hash=hash_key(token), api_key_id=identity.key_id, created_at=t,
                                 expires_at=t + int(seconds)))
    return token, identity


def dashboard_identity(session: Session, token: str | None) -> Identity | None:
    """The key behind a live session token; None when it is unknown, expired or its key revoked."""
    if not token:
        return None
    row = session.execute(
        select(ApiKey).join(DashboardSession, DashboardSession.api_key_id == ApiKey.id)
        .where(DashboardSession.token_hash == hash_key(token), DashboardSession.expires_at > now(),
               ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()
    return None if row is None else Identity(row.id, row.project_id, row.admin)


def close_dashboard_session(session: Session, token: str | None) -> None:
    """Sign out; expired sessions of any key are cleared at the same time."""
    condition = DashboardSession.expires_at <= now()
    if token:
        condition = condition | (DashboardSession.token_hash == hash_key(token))
    session.execute(delete(DashboardSession).where(condition))


def project_names(session: Session, ids: list[str] | None = None) -> dict[str, str]:
    """Project id -> name, of ``ids`` or of all projects."""
    query = select(Project.id, Project.name)
    if ids is not None:
        query = query.where(Project.id.in_(ids))
    return dict(session.execute(query).all())

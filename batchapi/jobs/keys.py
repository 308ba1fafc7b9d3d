"""Projects and their API keys. Only a SHA-256 of each key is stored; the key is shown once."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from batchapi.config import Settings
from batchapi.jobs.db import make_engine, make_sessionmaker, session_scope
from batchapi.jobs.errors import Unauthenticated
from batchapi.jobs.ids import new_id, now
from batchapi.jobs.models import ApiKey, Project

KEY_PREFIX = "sk-batch-"
DEFAULT_PROJECT = "default"  # owns everything when auth is off (the embedded default)


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


def create_api_key(session: Session, project_name: str) -> str:
    """Add a key to ``project_name`` (created if new) and return the key itself."""
    project = get_or_create_project(session, project_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiKey(id=new_id("key_"), project_id=project.id, key_hash=hash_key(key), prefix=key[:12], created_at=now())
    )
    return key


def authenticate(session: Session, key: str | None) -> str:
    """The project id ``key`` belongs to; ``Unauthenticated`` for a missing, unknown or revoked key."""
    if not key:
        raise Unauthenticated(
            "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'.",
            code="missing_api_key",
        )
    found = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))
    if found is None:
        shown = key[:8] + "…" if len(key) > 8 else "…"
        raise Unauthenticated(f"Incorrect API key provided: {shown}.")
    return found.project_id


def create_key(settings: Settings, project_name: str) -> str:
    """For ``batchapi keys create --project NAME``: a new key, committed (run migrations first)."""
    engine = make_engine(settings)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            return create_api_key(session, project_name)
    finally:
        engine.dispose()

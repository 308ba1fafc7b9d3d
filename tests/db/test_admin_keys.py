"""Dashboard sessions of API keys, on PostgreSQL (`batchapi keys create --admin`: tests/cli/test_keys.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from batchapi.config import load_settings
from batchapi.db.migrate import upgrade
from batchapi.db.models import DashboardSession
from batchapi.db.projects import (
    close_dashboard_session,
    create_api_key,
    dashboard_identity,
    list_keys,
    open_dashboard_session,
    revoke_key,
)
from batchapi.db.session import make_engine, make_sessionmaker, session_scope
from batchapi.errors import Unauthenticated


@pytest.fixture(scope="module")
def settings(tmp_path_factory, pg_url):
    settings = load_settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("admin"))
    upgrade(settings)
    return settings


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings)
    yield make_sessionmaker(engine)
    engine.dispose()


def test_a_dashboard_session_ends_on_sign_out_expiry_or_revocation(settings, sessions):
    with session_scope(sessions) as session:
        key = create_api_key(session, "dash-sessions")
    with session_scope(sessions) as session:
        token, identity = open_dashboard_session(session, key, 3600)
    assert token != key and key not in token
    with sessions() as session:
        assert dashboard_identity(session, token) == identity
        assert dashboard_identity(session, "not-a-token") is None and dashboard_identity(session, None) is None
        assert session.get(DashboardSession, token) is None  # only its hash is stored

    with session_scope(sessions) as session:
        close_dashboard_session(session, token)
    with sessions() as session:
        assert dashboard_identity(session, token) is None

    with session_scope(sessions) as session:
        expired, _ = open_dashboard_session(session, key, 3600)
        session.execute(update(DashboardSession).values(expires_at=0))
    with sessions() as session:
        assert dashboard_identity(session, expired) is None

    with session_scope(sessions) as session:
        live, _ = open_dashboard_session(session, key, 3600)
    [info] = list_keys(settings, "dash-sessions")
    assert revoke_key(settings, info.id)
    with sessions() as session:
        assert dashboard_identity(session, live) is None
    with pytest.raises(Unauthenticated), session_scope(sessions) as session:
        open_dashboard_session(session, key, 3600)

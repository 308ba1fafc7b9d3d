"""Listing and revoking API keys: the service functions, on PostgreSQL (`batchapi keys`: tests/cli)."""

from __future__ import annotations

import pytest

from batchapi.config import Settings, load_settings
from batchapi.db.migrate import upgrade
from batchapi.db.projects import authenticate, create_key, hash_key, list_keys, revoke_key
from batchapi.errors import NotFound, Unauthenticated
from tests.utils.sessions import in_session


@pytest.fixture(scope="module")
def settings(tmp_path_factory, pg_url) -> Settings:
    settings = load_settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("keys"))
    upgrade(settings)
    return settings


def authenticated_project(settings: Settings, key: str) -> str:
    return in_session(settings, lambda session: authenticate(session, key))


def test_list_shows_keys_without_their_secrets(settings):
    first, second = create_key(settings, "list-alpha"), create_key(settings, "list-alpha")
    other = create_key(settings, "list-beta")

    alpha = list_keys(settings, "list-alpha")
    assert [(k.project, k.prefix, k.revoked_at) for k in alpha] == [
        ("list-alpha", first[:12], None), ("list-alpha", second[:12], None)
    ]
    assert all(k.id.startswith("key_") and k.created_at > 0 for k in alpha)
    everything = list_keys(settings)
    assert {k.id for k in alpha} | {k.id for k in list_keys(settings, "list-beta")} <= {k.id for k in everything}
    shown = repr(everything)
    for key in (first, second, other):
        assert key not in shown and hash_key(key) not in shown
    assert list_keys(settings, "no-such-project") == []


def test_a_revoked_key_is_refused(settings):
    key = create_key(settings, "revoke-me")
    project_id = authenticated_project(settings, key)
    [info] = list_keys(settings, "revoke-me")

    assert revoke_key(settings, info.id) is True
    with pytest.raises(Unauthenticated, match=r"^Incorrect API key provided: sk-batch…\.$") as exc:
        authenticated_project(settings, key)
    assert exc.value.code == "invalid_api_key"
    [revoked] = list_keys(settings, "revoke-me")
    assert revoked.revoked_at is not None and revoked.revoked_at >= info.created_at

    assert revoke_key(settings, info.id) is False  # twice is harmless and keeps the first time
    assert list_keys(settings, "revoke-me") == [revoked]
    # the project's other keys still work
    assert authenticated_project(settings, create_key(settings, "revoke-me")) == project_id


def test_revoking_an_unknown_id_is_not_found(settings):
    with pytest.raises(NotFound, match=r"^No such API key: key_missing$"):
        revoke_key(settings, "key_missing")

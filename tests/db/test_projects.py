"""Listing and revoking API keys: the service functions and `batchapi keys`, on PostgreSQL."""

from __future__ import annotations

import json

import pytest

from batchapi.cli import main
from batchapi.config import Settings, load_settings
from batchapi.db.migrate import upgrade
from batchapi.db.projects import authenticate, create_key, hash_key, list_keys, revoke_key
from batchapi.db.session import make_engine, make_sessionmaker, session_scope
from batchapi.errors import NotFound, Unauthenticated


@pytest.fixture(scope="module")
def settings(tmp_path_factory, pg_url) -> Settings:
    settings = load_settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("keys"))
    upgrade(settings)
    return settings


@pytest.fixture
def cli_env(monkeypatch, settings):
    """`batchapi` reads its settings from the environment: point it at the test database."""
    monkeypatch.setenv("BATCHAPI_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("BATCHAPI_DATA_DIR", str(settings.data_dir))


def authenticated_project(settings: Settings, key: str) -> str:
    engine = make_engine(settings)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            return authenticate(session, key)
    finally:
        engine.dispose()


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


def test_cli_lists_and_revokes(cli_env, settings, capsys):
    assert main(["keys", "create", "--project", "cli-project"]) == 0
    key = capsys.readouterr().out.splitlines()[-1]

    assert main(["keys", "list", "--project", "cli-project", "--json"]) == 0
    out = capsys.readouterr().out
    [listed] = json.loads(out)
    assert listed.keys() == {"id", "project", "prefix", "created_at", "revoked_at", "admin"}
    assert (listed["project"], listed["prefix"], listed["revoked_at"]) == ("cli-project", key[:12], None)
    assert key not in out

    assert main(["keys", "list", "--project", "cli-project"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["id", "project", "key", "created", "revoked"]
    assert table[1].split()[:3] == [listed["id"], "cli-project", key[:12] + "…"]
    assert len(table) == 2

    assert main(["keys", "revoke", listed["id"]]) == 0
    assert capsys.readouterr().out == f"{listed['id']} revoked\n"
    assert main(["keys", "revoke", listed["id"]]) == 0
    assert capsys.readouterr().out == f"{listed['id']} was already revoked\n"
    with pytest.raises(Unauthenticated):
        authenticated_project(settings, key)

    assert main(["keys", "list", "--project", "cli-project", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["revoked_at"] is not None


def test_cli_revoke_of_an_unknown_id_fails_with_one_line(cli_env, capsys):
    assert main(["keys", "revoke", "key_missing"]) == 1
    assert capsys.readouterr().out == "error: No such API key: key_missing\n"

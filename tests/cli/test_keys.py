"""``batchapi keys create | list | revoke`` on PostgreSQL, as a person runs them."""

from __future__ import annotations

import json

import pytest

from batchapi.cli import main
from batchapi.config import Settings, load_settings
from batchapi.db.migrate import upgrade
from batchapi.db.projects import Identity, identify
from batchapi.errors import Unauthenticated
from tests.utils.sessions import in_session


@pytest.fixture(scope="module")
def settings(tmp_path_factory, pg_url) -> Settings:
    settings = load_settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("keys-cli"))
    upgrade(settings)
    return settings


@pytest.fixture(autouse=True)
def cli_env(monkeypatch, settings):
    """`batchapi` reads its settings from the environment: point it at the test database."""
    monkeypatch.setenv("BATCHAPI_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("BATCHAPI_DATA_DIR", str(settings.data_dir))


def identified(settings: Settings, key: str) -> Identity:
    return in_session(settings, lambda session: identify(session, key))


def test_lists_and_revokes(settings, capsys):
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
        identified(settings, key)

    assert main(["keys", "list", "--project", "cli-project", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["revoked_at"] is not None


def test_revoke_of_an_unknown_id_fails_with_one_line(capsys):
    assert main(["keys", "revoke", "key_missing"]) == 1
    assert capsys.readouterr() == ("", "batchapi keys revoke: No such API key: key_missing\n")


def test_create_admin_makes_an_admin_key(settings, capsys):
    assert main(["keys", "create", "--project", "ops-admin", "--admin"]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["keys", "create", "--project", "ops-admin"]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--project", "ops-admin", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [entry["admin"] for entry in listed] == [True, False]
    identity = identified(settings, key)
    assert identity.admin and identity.key_id == listed[0]["id"]

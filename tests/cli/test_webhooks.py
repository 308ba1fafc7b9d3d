"""``batchapi webhooks create | list | rotate | deliveries | delete`` on the embedded default's
SQLite database, as a person runs them."""

from __future__ import annotations

import json
import logging

import pytest

from batchapi import cli
from batchapi.batches import states
from batchapi.batches.states import BatchStatus
from batchapi.config import load_settings
from batchapi.context import open_context
from batchapi.db.migrate import upgrade
from batchapi.db.models import Batch, Project
from batchapi.db.session import session_scope
from tests.utils.job_rows import make_batch


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BATCHAPI_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHAPI_WEBHOOK_ALLOW_PRIVATE", "true")  # its endpoints are on 127.0.0.1
    upgrade(load_settings())
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def run(*argv: str) -> tuple[int, list[str]]:
        """The exit status, and stdout's lines or, on a failure, stderr's."""
        capsys.readouterr()
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, (out if code == 0 else err).strip().splitlines()

    yield run
    # the CLI gives the root logger a handler on this test's captured stderr, closed after it
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_create_list_rotate_deliveries_delete(run):
    assert run("keys", "create", "--project", "nightly")[0] == 0
    code, out = run("webhooks", "create", "--project", "nightly", "--url", "http://127.0.0.1:9/hooks",
                    "--events", "batch.completed", "batch.failed")
    assert code == 0 and out[-1].startswith("whsec_")
    secret = out[-1]
    code, out = run("webhooks", "list", "--json")
    [listed] = json.loads("\n".join(out))
    assert (listed["url"], listed["event_types"]) == ("http://127.0.0.1:9/hooks", ["batch.completed", "batch.failed"])
    assert secret not in "\n".join(out)  # listings never show a secret
    code, out = run("webhooks", "rotate", listed["id"])
    assert code == 0 and out[-1].startswith("whsec_") and out[-1] != secret

    ctx = open_context(load_settings())
    try:
        batch_id, _ = make_batch(ctx, 0)
        with session_scope(ctx.sessions) as session:
            project_id = session.query(Project).filter_by(name="nightly").one().id
            session.query(Batch).filter_by(id=batch_id).update({"project_id": project_id})
        with session_scope(ctx.sessions) as session:
            assert states.transition(session, batch_id, BatchStatus.FAILED)
    finally:
        ctx.close()
    code, out = run("webhooks", "deliveries", "--project", "nightly", "--json")
    [delivery] = json.loads("\n".join(out))
    assert (delivery["batch_id"], delivery["event_type"], delivery["status"], delivery["attempts"]) == (
        batch_id, "batch.failed", "pending", 0)
    code, out = run("webhooks", "deliveries")
    assert code == 0 and any(batch_id in line for line in out)

    assert run("webhooks", "delete", listed["id"])[0] == 0
    assert json.loads("\n".join(run("webhooks", "list", "--json")[1])) == []
    assert run("webhooks", "delete", listed["id"])[0] == 1


def test_bad_input_is_an_error_message(run):
    code, err = run("webhooks", "create", "--project", "nobody", "--url", "http://127.0.0.1:9/")
    assert (code, err) == (1, ["batchapi webhooks create: no project named 'nobody' (`batchapi keys create --project "
                               "nobody` makes one)"])
    run("keys", "create", "--project", "p")
    code, err = run("webhooks", "create", "--project", "p", "--url", "ftp://x/")
    assert (code, err) == (1, ["batchapi webhooks create: 'ftp://x/' is not an http(s) URL of at most 2048 characters"])
    code, err = run("webhooks", "rotate", "we_nope")
    assert (code, err) == (1, ["batchapi webhooks rotate: No such webhook endpoint: we_nope"])
    with pytest.raises(SystemExit):  # argparse refuses an unknown event type
        run("webhooks", "create", "--project", "p", "--url", "http://x.test/", "--events", "batch.done")

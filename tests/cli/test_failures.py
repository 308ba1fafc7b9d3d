"""Every command's failure paths, as a person meets them: each prints exactly one line to stderr,
``batchapi COMMAND: what failed; what to do``, never a traceback, and exits 1 (2 for a usage
error, 130 on Ctrl-C). The API runs once for the module, on SQLite with auth on and no worker."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from batchapi.cli import main
from batchapi.cli.client import api_url
from batchapi.cli.failures import CommandError
from batchapi.config import DEFAULT_MODEL
from batchapi.db.migrate import upgrade
from batchapi.db.projects import create_api_key
from batchapi.db.session import session_scope
from tests.utils.batch_service import jsonl, live_server, request_line, service_settings
from tests.utils.services import free_port

NO_SERVER = "is `batchapi serve` running there?"
NO_DATABASE = "is it running, and is BATCHAPI_DATABASE_URL right?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    settings = service_settings(tmp_path_factory.mktemp("cli-failures"), smollm2_dir)  # no worker: no weights read
    assert settings.auth_required
    upgrade(settings)
    # the server shares this process and its stderr: its INFO lines ("batch ... valid") are not the CLI's
    loggers = [logging.getLogger(f"batchapi.{name}") for name in ("api", "batches", "validation")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with live_server(settings) as server:
            yield server
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@pytest.fixture(scope="module")
def key(server) -> str:
    with session_scope(server.ctx.sessions) as session:
        return create_api_key(session, "cli-failures")


@pytest.fixture
def batch_file(tmp_path, server):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([request_line("a", server.app.state.model.id)]))
    return path


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    """No key or settings from the environment of whoever runs the tests."""
    for name in [n for n in os.environ if n.startswith("BATCHAPI_")] + ["OPENAI_API_KEY"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BATCHAPI_DATA_DIR", str(tmp_path / "data"))


def one_line(ran) -> str:
    assert len(ran.err) == 1, ran.err
    return ran.err[0]


# the base URL


@pytest.mark.parametrize("given", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
                                   " http://h:8000/v1 "])
def test_a_base_url_with_or_without_v1_is_the_sdks_v1(given):
    assert api_url(given, "127.0.0.1", 8000) == "http://h:8000/v1"
    assert api_url(given.replace("h:8000", "h:8000/proxy"), "127.0.0.1", 8000) == "http://h:8000/proxy/v1"


def test_without_a_base_url_it_is_the_server_of_the_settings():
    assert api_url(None, "127.0.0.2", 9000) == "http://127.0.0.2:9000/v1"
    assert api_url(None, "0.0.0.0", 8000) == "http://127.0.0.1:8000/v1"  # bound everywhere: reached here


@pytest.mark.parametrize("given", ["127.0.0.1:8000", "localhost:8000", "ftp://h/", "http://", "http://h:port"])
def test_a_base_url_that_is_not_http_is_a_usage_error(given):
    with pytest.raises(CommandError, match=r"^--base-url .* is not an http\(s\) URL") as exc:
        api_url(given, "127.0.0.1", 8000)
    assert exc.value.status == 2


def test_submit_takes_the_base_url_with_or_without_v1(cli, server, key, batch_file):
    for suffix in ("", "/", "/v1", "/v1/"):
        ran = cli("submit", str(batch_file), "--base-url", server.base_url + suffix, "--api-key", key)
        assert ran.code == 0 and "batch batch_" in ran.out, (suffix, ran)
        assert not [line for line in ran.err if line.startswith("batchapi submit")]


def test_a_base_url_that_is_not_a_url_is_a_usage_error(cli, batch_file):
    ran = cli("submit", str(batch_file), "--base-url", "localhost:8000")
    assert ran.code == 2
    assert one_line(ran) == ("batchapi submit: --base-url 'localhost:8000' is not an http(s) URL; give one like "
                             "http://127.0.0.1:8000")


# the server


@pytest.mark.parametrize("argv", [["submit", "FILE"], ["batches", "show", "batch_x"]])
def test_nothing_listening_at_the_url(cli, batch_file, argv):
    port = free_port()
    ran = cli(*[str(batch_file) if a == "FILE" else a for a in argv], "--base-url", f"http://127.0.0.1:{port}")
    assert ran.code == 1
    assert one_line(ran) == (f"batchapi {' '.join(argv[:2]) if argv[0] == 'batches' else 'submit'}: cannot reach "
                             f"http://127.0.0.1:{port}/v1 (connection refused); {NO_SERVER}")


def test_the_default_url_is_the_settings_host_and_port(cli, batch_file, monkeypatch):
    port = free_port()
    monkeypatch.setenv("BATCHAPI_PORT", str(port))
    ran = cli("submit", str(batch_file))
    assert one_line(ran) == f"batchapi submit: cannot reach http://127.0.0.1:{port}/v1 (connection refused); {NO_SERVER}"


def test_a_url_that_is_not_the_api(cli, server, key):
    ran = cli("batches", "list", "--base-url", server.base_url + "/api", "--api-key", key)
    assert ran.code == 1
    assert one_line(ran) == (f"batchapi batches list: GET {server.base_url}/api/v1/batches?limit=20 is not found (404): "
                             f"{server.base_url}/api/v1 is not the API of `batchapi serve`; give --base-url as "
                             "http://HOST:PORT")


def test_a_wrong_or_missing_api_key(cli, server, batch_file):
    hint = "(401 unauthorized); pass --api-key or set OPENAI_API_KEY (`batchapi keys create --project NAME` makes a key)"
    ran = cli("submit", str(batch_file), "--base-url", server.base_url, "--api-key", "sk-batch-wrong")
    assert ran.code == 1
    assert one_line(ran) == f"batchapi submit: Incorrect API key provided: sk-batch… {hint}"
    ran = cli("batches", "list", "--base-url", server.base_url)  # no --api-key, no OPENAI_API_KEY
    assert ran.code == 1
    assert one_line(ran) == f"batchapi batches list: Incorrect API key provided: … {hint}"


@pytest.mark.parametrize("action", ["show", "cancel", "download", "retry"])
def test_a_batch_id_that_does_not_exist(cli, server, key, action):
    ran = cli("batches", action, "batch_nope", "--base-url", server.base_url, "--api-key", key)
    assert ran.code == 1
    assert one_line(ran) == (f"batchapi batches {action}: No batch found with id 'batch_nope' (404 not found); "
                             "`batchapi batches list` shows the batches")


def test_downloading_a_batch_that_has_no_output_yet(cli, server, key, batch_file, tmp_path):
    out = cli("submit", str(batch_file), "--base-url", server.base_url, "--api-key", key).out
    batch_id = out.split("batch ")[-1].split()[0]
    ran = cli("batches", "download", batch_id, "-o", str(tmp_path), "--base-url", server.base_url, "--api-key", key)
    assert ran.code == 1
    line = one_line(ran)
    assert line.startswith(f"batchapi batches download: batch {batch_id} (") and line.endswith(
        f"has no output or error file yet; `batchapi batches show {batch_id} --wait` follows it"), line


def test_ctrl_c_while_following_a_batch(cli, server, key, batch_file, monkeypatch):
    """No worker runs here, so the batch never ends: the Ctrl-C lands while ``--wait`` follows it, in
    its wait between two polls (a real SIGINT, raised on the main thread there: a timer's could land
    in the upload instead, on a loaded machine, where an HTTP library may swallow it)."""
    import time
    from types import SimpleNamespace

    from batchapi.cli import submit

    def ctrl_c(seconds):
        signal.raise_signal(signal.SIGINT)  # the handler runs now, on this thread, as Ctrl-C's would
        time.sleep(seconds)

    # Python's own SIGINT handler, as a terminal's process has it (something earlier in a full suite's
    # process can leave another one installed: seen once, the Ctrl-C then never arrived)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request_restore = lambda: signal.signal(signal.SIGINT, previous)  # noqa: E731
    monkeypatch.setattr(submit, "time", SimpleNamespace(time=time.time, monotonic=time.monotonic,
                                                        strftime=time.strftime, localtime=time.localtime,
                                                        sleep=ctrl_c))
    try:
        ran = cli("submit", str(batch_file), "--wait", "--base-url", server.base_url, "--api-key", key)
    finally:
        request_restore()
    assert ran.code == 130 and "batch batch_" in ran.out
    assert one_line(ran) == "batchapi submit: interrupted"


# files


def test_a_file_that_does_not_exist_or_is_not_a_batch_file(cli, tmp_path):
    port = free_port()  # nothing is sent: the file is read first
    url = f"http://127.0.0.1:{port}"
    ran = cli("submit", str(tmp_path / "missing.jsonl"), "--base-url", url)
    assert (ran.code, one_line(ran)) == (1, f"batchapi submit: {tmp_path / 'missing.jsonl'}: No such file or directory")
    ran = cli("submit", str(tmp_path), "--base-url", url)
    assert (ran.code, one_line(ran)) == (1, f"batchapi submit: {tmp_path}: Is a directory")

    (tmp_path / "empty.jsonl").write_text("\n\n")
    ran = cli("submit", str(tmp_path / "empty.jsonl"), "--base-url", url)
    assert one_line(ran) == (f"batchapi submit: {tmp_path / 'empty.jsonl'} holds no requests; give a JSONL batch "
                             "file, one request a line")
    (tmp_path / "notes.txt").write_text("\nhello\n")
    ran = cli("submit", str(tmp_path / "notes.txt"), "--base-url", url)
    assert one_line(ran) == (f"batchapi submit: {tmp_path / 'notes.txt'}: line 2 is not a batch request line with a "
                             '"url"; give a JSONL batch file, or the endpoint with --endpoint')


def test_a_file_that_cannot_be_opened(cli, tmp_path):
    """Any OSError of opening the file is one line (root reads files whatever their mode, so the
    case every user can meet is a path through a file)."""
    (tmp_path / "plain").write_text("x")
    path = tmp_path / "plain" / "requests.jsonl"
    ran = cli("submit", str(path), "--base-url", f"http://127.0.0.1:{free_port()}")
    assert (ran.code, one_line(ran)) == (1, f"batchapi submit: {path}: Not a directory")


# models and settings


def test_models_pull_of_an_unknown_name(cli):
    ran = cli("models", "pull", "no-such-model")
    assert ran.code == 1
    assert one_line(ran).startswith("batchapi models pull: unknown model 'no-such-model'; known: ")
    assert DEFAULT_MODEL in ran.err[0]


@pytest.mark.parametrize("argv", [["models", "list"], ["submit", "in.jsonl"], ["keys", "list"], ["webhooks", "list"]])
def test_invalid_settings_are_a_usage_error(cli, monkeypatch, argv):
    monkeypatch.setenv("BATCHAPI_DTYPE", "int4")
    ran = cli(*argv)
    assert ran.code == 2
    assert one_line(ran) == (f"batchapi {' '.join(argv[:2]) if argv[0] != 'submit' else 'submit'}: invalid settings: "
                             "BATCHAPI_DTYPE: Input should be 'auto', 'bfloat16', 'float16' or 'float32'; fix it in "
                             "the environment")


def test_a_command_that_needs_a_broker(cli):
    ran = cli("worker")
    assert ran.code == 2
    assert one_line(ran) == ("batchapi worker: `batchapi worker` needs BATCHAPI_BROKER_URL (without one, "
                             "`batchapi serve` runs the worker itself)")


# the database of the admin commands


@pytest.mark.parametrize("argv", [["keys", "create", "--project", "p"], ["keys", "list"], ["keys", "revoke", "key_x"],
                                  ["webhooks", "list"], ["webhooks", "deliveries"], ["db", "upgrade"]])
def test_a_database_where_nothing_listens(cli, monkeypatch, argv):
    port = free_port()
    monkeypatch.setenv("BATCHAPI_DATABASE_URL", f"postgresql://postgres:s3cret@127.0.0.1:{port}/batchapi")
    ran = cli(*argv)
    assert ran.code == 1
    assert one_line(ran) == (f"batchapi {' '.join(argv[:2])}: cannot connect to the database "
                             f"postgresql://postgres:***@127.0.0.1:{port}/batchapi (connection refused); {NO_DATABASE}")


def test_a_database_that_does_not_exist(cli, monkeypatch, pg_url):
    monkeypatch.setenv("BATCHAPI_DATABASE_URL", pg_url.rsplit("/", 1)[0] + "/batchapi_no_such_db")
    ran = cli("keys", "list")
    assert ran.code == 1
    assert one_line(ran).endswith('(database "batchapi_no_such_db" does not exist); ' + NO_DATABASE), ran.err


@pytest.mark.parametrize("argv", [["keys", "list"], ["webhooks", "list"]])
def test_a_database_without_the_tables(cli, tmp_path, argv):
    ran = cli(*argv)
    assert ran.code == 1
    line = one_line(ran)
    assert line.startswith(f"batchapi {' '.join(argv)}: the database sqlite:///{tmp_path / 'data'}/batchapi.db has "
                           "no batchapi tables (no such table: ") and line.endswith("); run `batchapi db upgrade` first")


# a bug


def test_a_bug_is_one_line_unless_debug(cli, monkeypatch):
    def broken(_cache_dir):
        raise RuntimeError("boom")

    monkeypatch.setattr("batchapi.models.store.list_models", broken)
    ran = cli("models", "list")
    assert ran.code == 1
    assert one_line(ran) == ("batchapi models list: unexpected RuntimeError: boom (a bug; "
                             "`batchapi --debug models list ...` shows the traceback)")
    with pytest.raises(RuntimeError, match="boom"):
        main(["--debug", "models", "list"])

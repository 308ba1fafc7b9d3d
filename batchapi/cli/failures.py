"""What a person sees when a ``batchapi`` command fails: one line, what failed and what to do.

``explain`` words each failure a person can cause or meet (no server at the URL, a wrong URL or
key, an unknown id, a missing file, invalid settings, an unreachable database, Ctrl-C) and picks
the exit status; anything else is a bug, and gets ``None``.
"""

from __future__ import annotations

import http
import shlex
import subprocess
from dataclasses import dataclass

FAILED = 1
USAGE = 2  # the command line or the settings are wrong: argparse's own status for its errors
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
MAX_CHARS = 400  # of a message quoted from a server, a driver or the OS


class CommandError(Exception):
    """A failure a command found itself, already worded for a person."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.status = USAGE if usage else FAILED


@dataclass(frozen=True)
class Failure:
    line: str
    status: int = FAILED


def explain(exc: BaseException, base_url: str | None) -> Failure | None:
    """The line and status for ``exc``; ``base_url`` is the API the command talked to, if any."""
    import openai
    import sqlalchemy.exc

    from batchapi.config import SettingsError
    from batchapi.errors import ServiceError
    from batchapi.models.store import ModelNotFound

    if isinstance(exc, KeyboardInterrupt):
        return Failure("interrupted", INTERRUPTED)
    if isinstance(exc, CommandError):
        return Failure(str(exc), exc.status)
    if isinstance(exc, SettingsError):
        return Failure(f"{exc}; fix it in the environment", USAGE)
    if isinstance(exc, ModelNotFound | ServiceError):
        return Failure(one_line(exc.message if isinstance(exc, ServiceError) else exc))
    if isinstance(exc, openai.APIStatusError):
        return Failure(_refused(exc, base_url))
    if isinstance(exc, openai.APIConnectionError):
        reason = "timed out" if isinstance(exc, openai.APITimeoutError) else _reason(exc)
        return Failure(f"cannot reach {base_url} ({reason}); is `batchapi serve` running there?")
    if isinstance(exc, openai.APIError):  # an answer that is not an OpenAI API's
        return Failure(f"{base_url} answered {one_line(exc.message)}; is it the API of `batchapi serve`?")
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return Failure(_database(exc))
    if isinstance(exc, sqlalchemy.exc.ArgumentError):  # a database URL SQLAlchemy cannot parse
        return Failure(f"BATCHAPI_DATABASE_URL: {one_line(exc)}", USAGE)
    if isinstance(exc, OSError):
        return Failure(_os_error(exc))
    if isinstance(exc, subprocess.CalledProcessError):  # `models pull`'s pip, offline say: it printed why
        command = shlex.join(exc.cmd) if isinstance(exc.cmd, list | tuple) else exc.cmd
        return Failure(f"`{command}` exited {exc.returncode}; its output above tells why")
    return None


def unexpected(exc: BaseException, command: str) -> Failure:
    """A bug: what it raised, and how to see where (``command`` as typed, ``batchapi submit``)."""
    again = command.replace("batchapi", "batchapi --debug", 1)
    return Failure(f"unexpected {type(exc).__name__}: {one_line(exc)} (a bug; `{again} ...` shows the traceback)")


def one_line(text: object) -> str:
    words = " ".join(str(text).split())
    return words if len(words) <= MAX_CHARS else words[: MAX_CHARS - 1] + "…"


def _refused(exc, base_url: str | None) -> str:
    """An error status from the API, with the message it sent."""
    status = exc.status_code
    body = exc.body if isinstance(exc.body, dict) else {}
    request = f"{exc.request.method} {exc.request.url}"
    if status == 404 and body.get("param") is None:  # no such route: not batchapi's /v1 at this URL
        return (f"{request} is not found (404): {base_url} is not the API of `batchapi serve`; give "
                "--base-url as http://HOST:PORT")
    try:
        phrase = http.HTTPStatus(status).phrase.lower()
    except ValueError:
        phrase = "error"
    line = f"{one_line(body.get('message') or request).removesuffix('.')} ({status} {phrase})"
    if status == 401:
        return line + "; pass --api-key or set OPENAI_API_KEY (`batchapi keys create --project NAME` makes a key)"
    if status == 404 and body.get("param") == "batch_id":
        return line + "; `batchapi batches list` shows the batches"
    if status == 429:
        return line + "; try again in a while"
    if status >= 500:
        return line + "; the server's log tells why"
    return line


def _reason(exc: BaseException) -> str:
    """What the OS said at the root of a connection failure ("connection refused")."""
    reason, seen = str(exc.__cause__ or exc), set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.strerror:
            reason = exc.strerror
        exc = exc.__cause__ or exc.__context__
    return one_line(reason[:1].lower() + reason[1:])


def _database(exc) -> str:
    said = one_line(str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else exc)
    where = _database_url()
    if exc.statement is None:  # failed to connect: the statement is only known once connected
        reason = said.rsplit("failed: ", 1)[-1].removeprefix("FATAL:").strip()
        check = ("is BATCHAPI_DATA_DIR writable?" if where.startswith("sqlite")
                 else "is it running, and is BATCHAPI_DATABASE_URL right?")
        return f"cannot connect to the database {where} ({reason[:1].lower() + reason[1:]}); {check}"
    if "no such table" in said or getattr(exc.orig, "sqlstate", None) == "42P01":  # SQLite's, PostgreSQL's
        return f"the database {where} has no batchapi tables ({said}); run `batchapi db upgrade` first"
    return f"the database {where} refused a query ({said})"


def _database_url() -> str:
    """The settings' database URL without its password."""
    from sqlalchemy.engine import make_url

    from batchapi.config import load_settings

    settings = load_settings()
    return make_url(settings.database_url or settings.sqlalchemy_url).render_as_string(hide_password=True)


def _os_error(exc: OSError) -> str:
    if exc.filename is None:
        return one_line(exc.strerror or exc)
    if exc.filename2 is not None:
        return f"{exc.filename} -> {exc.filename2}: {exc.strerror}"
    return f"{exc.filename}: {exc.strerror}"

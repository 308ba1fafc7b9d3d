"""One log format for every process (API, workers, beat, the embedded default, the CLI).

Plain text by default; one JSON object per line with ``BATCHAPI_LOG_FORMAT=json``: ``timestamp``
(UTC, ISO 8601), ``level``, ``logger``, ``message``, and where known ``request_id``, ``batch_id``
and ``shard_id`` (and ``exception`` with the traceback). The ids come from, in order: the record's
``extra``, the context variables below (the API sets ``request_id`` per request; ``bind`` sets any
of them for a block of code), and for batch and shard ids the message itself, since the service's
ids are unambiguous (``batch_<hex>``, a shard ``batch_<hex>_<5 digits>``).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

request_id_var: ContextVar[str | None] = ContextVar("batchapi_request_id", default=None)
batch_id_var: ContextVar[str | None] = ContextVar("batchapi_batch_id", default=None)
shard_id_var: ContextVar[str | None] = ContextVar("batchapi_shard_id", default=None)

FIELDS = {"request_id": request_id_var, "batch_id": batch_id_var, "shard_id": shard_id_var}
IDS_IN_TEXT = re.compile(r"\b(batch_[0-9a-f]{13,})(_\d{5})?\b")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn's loggers: without handlers of their own they reach the root's, in this format
UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


@contextmanager
def bind(**ids: str | None) -> Iterator[None]:
    """Attach ``request_id``/``batch_id``/``shard_id`` to every record logged inside the block
    (in this thread or task; contextvars do not cross into new threads)."""
    tokens = [(FIELDS[name], FIELDS[name].set(value)) for name, value in ids.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class ContextFilter(logging.Filter):
    """Puts the ids on every record, so both formatters (and any handler) can read them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in FIELDS.items():
            if getattr(record, name, None) is None:
                setattr(record, name, var.get())
        if record.batch_id is None:
            found = IDS_IN_TEXT.search(record.getMessage())
            if found:
                record.batch_id = found.group(1)
                if found.group(2) and record.shard_id is None:
                    record.shard_id = found.group(0)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{name}={getattr(record, name)}" for name in FIELDS if getattr(record, name, None))
        if not ids:
            return line
        head, sep, rest = line.partition("\n")  # after the message, before a traceback
        return f"{head} [{ids}]{sep}{rest}"


class _StderrHandler(logging.StreamHandler):
    """The process's own stderr (fd 2, ``sys.__stderr__``): not ``sys.stderr``, which Celery replaces
    with a proxy that logs what is written to it, and a test runner with a buffer it closes later."""

    def __init__(self):
        super().__init__(sys.__stderr__ or sys.stderr)


def configure(log_format: str = "text", level: int = logging.INFO) -> None:
    """The root logger's one handler on stderr, in ``log_format`` (``text`` or ``json``); uvicorn's
    and Celery's loggers propagate to it. Safe to call again: it replaces the handler. (Celery
    prints its start-up banner, which ``batchapi worker`` leaves out in JSON mode, and a line on
    shutdown to stdout, not through logging.)"""
    assert log_format in ("text", "json"), f"unknown log format {log_format!r}"
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        # ours from an earlier call, and basicConfig's plain one; others (a test runner's capture) stay
        if isinstance(old, _StderrHandler) or type(old) is logging.StreamHandler:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # Python's warnings too (logger ``py.warnings``), in the same format
    for name in UVICORN:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True

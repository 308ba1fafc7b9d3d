"""The ``openai`` SDK client of ``batchapi submit`` and ``batchapi batches``, and the one place
their ``--base-url`` is read."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from batchapi.cli.failures import CommandError

EVERY_INTERFACE = ("0.0.0.0", "::", "")  # a server bound there is reached on this machine's loopback


def api_url(given: str | None, host: str, port: int) -> str:
    """The SDK's base URL, ``.../v1``, from ``--base-url`` as people type it: ``http://HOST:PORT``
    with or without a trailing ``/`` or ``/v1``; without one, the server these settings start."""
    url = (given or f"http://{'127.0.0.1' if host in EVERY_INTERFACE else host}:{port}").strip().rstrip("/")
    parts = urlsplit(url)
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:  # a port that is not a number up to 65535
        valid = False
    if not valid:
        raise CommandError(f"--base-url {given!r} is not an http(s) URL; give one like http://127.0.0.1:8000",
                           usage=True)
    return url if url.endswith("/v1") else url + "/v1"


def client_for(base_url: str, api_key: str | None):
    from openai import OpenAI, OpenAIError

    for noisy in ("httpx", "httpx2", "openai"):  # a line per request would drown the output
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return OpenAI(base_url=base_url, api_key=api_key)
    except OpenAIError:  # no key given nor in OPENAI_API_KEY: a server with auth off takes any
        return OpenAI(base_url=base_url, api_key="none")

"""Waiting in tests: the one poll loop, and the wait for a batch built on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TypeVar

import httpx

from batchapi.batches.states import TERMINAL, BatchStatus

T = TypeVar("T")
PAST_VALIDATION = frozenset(BatchStatus) - {BatchStatus.VALIDATING}


def wait_until(probe: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, message: str = "",
               until: Callable[[T], object] = bool) -> T:
    """Call ``probe`` every ``interval`` seconds until ``until`` accepts what it returned (by
    default: until that is truthy), and return that value. The last call falls at the deadline,
    so a condition met only later fails: an AssertionError naming ``message`` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if until(value):
            return value
        left = deadline - time.monotonic()
        assert left > 0, f"timed out after {timeout} s waiting for {message or 'the condition'}; last seen: {value!r}"
        time.sleep(min(interval, left))


def read_batch(client, batch_id: str):
    """The batch as ``client`` reads it: the JSON dict through an ``httpx.Client`` on the service's
    base URL, else (an ``openai.OpenAI``) the SDK's ``Batch``."""
    if isinstance(client, httpx.Client):
        response = client.get(f"/v1/batches/{batch_id}")
        assert response.status_code == 200, response.text
        return response.json()
    return client.batches.retrieve(batch_id)


def status_of(batch) -> str:
    return batch["status"] if isinstance(batch, dict) else batch.status


def wait_for_batch(client, batch_id: str, statuses: Collection[str] = TERMINAL, until: Callable | None = None,
                   timeout: float = 120.0, interval: float = 0.1, message: str | None = None):
    """Poll the batch (``read_batch``) until its status is one of ``statuses``, or until
    ``until(batch)`` holds when given; return it. A batch that ends before ``until`` holds fails
    at once: an ended batch changes no more."""
    done = until or (lambda batch: status_of(batch) in statuses)
    what = message or (f"batch {batch_id} to be {' or '.join(sorted(statuses))}" if until is None
                       else f"batch {batch_id}")

    def finished(batch) -> bool:
        if done(batch):
            return True
        assert status_of(batch) not in TERMINAL, f"batch ended {status_of(batch)} while waiting for {what}: {batch}"
        return False

    return wait_until(lambda: read_batch(client, batch_id), timeout, interval, what, until=finished)


def wait_for_message_batch(client, batch_id: str, timeout: float = 300.0, interval: float = 0.3):
    """Poll a Message Batch through the anthropic SDK until it has ended; return it."""
    return wait_until(lambda: client.messages.batches.retrieve(batch_id), timeout, interval,
                      f"message batch {batch_id} to end", until=lambda batch: batch.processing_status == "ended")

"""One call of the backend as batches: request lines in, one result body per ``custom_id`` out.

The lines go up as few input files as the service's file limits allow (lines and bytes, see
docs/OPERATIONS.md "Limits"), each file one batch on ``/v1/completions``; one progress bar follows
them all until every batch has ended. A request that did not succeed (refused, failed, expired,
cancelled) fails the whole call with its ``custom_id`` and error: an evaluation never scores a
request it has no result for.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tqdm import tqdm

logger = logging.getLogger(__name__)

ENDPOINT = "/v1/completions"
TERMINAL = {"completed", "failed", "expired", "cancelled"}
# the first wait between polls, doubled up to ``poll_seconds``: a batch the result cache answers
# ends within a few tenths of a second, which a fixed one-second poll would more than double
FIRST_POLL_SECONDS = 0.05


class EvalRequestFailed(RuntimeError):
    """A request of the evaluation has no result: the run cannot be scored."""

    def __init__(self, custom_id: str | None, error: str):
        self.custom_id = custom_id
        self.error = error
        where = f"request {custom_id}" if custom_id else "the evaluation's batch"
        super().__init__(f"{where} failed: {error}")


@dataclass(frozen=True)
class Limits:
    """What one input file may hold: the service's ``BATCHAPI_MAX_FILE_LINES`` and
    ``BATCHAPI_MAX_FILE_BYTES`` (their defaults here)."""

    max_lines: int = 50_000
    max_bytes: int = 200 * 1024 * 1024

    def __post_init__(self):
        assert self.max_lines >= 1 and self.max_bytes >= 1, f"file limits must be positive: {self}"


def encode_line(custom_id: str, body: dict) -> bytes:
    record = {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": body}
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def split_files(lines: list[bytes], limits: Limits) -> Iterator[bytes]:
    """The encoded lines packed into files, in order, each within ``limits``."""
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        if len(line) > limits.max_bytes:
            raise ValueError(f"a request line of {len(line)} bytes is over the file limit of {limits.max_bytes}")
        if chunk and (len(chunk) == limits.max_lines or size + len(line) > limits.max_bytes):
            yield b"".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += len(line)
    if chunk:
        yield b"".join(chunk)


def error_text(record: dict) -> str:
    """What an error-file line says went wrong: the refusal's body, or why it never ran."""
    response = record.get("response") or {}
    error = (response.get("body") or {}).get("error") or record.get("error") or {}
    code, message = error.get("code"), error.get("message")
    if code or message:
        return f"{code}: {message}" if code else str(message)
    return f"status {response.get('status_code')}: {json.dumps(record)}"


class BatchRunner:
    """Runs request lines as batches through the service's Files and Batches API."""

    def __init__(self, client, limits: Limits = Limits(), poll_seconds: float = 1.0,
                 completion_window: str = "24h", metadata: dict | None = None):
        self.client = client  # an ``openai.OpenAI`` on the service's ``/v1``
        self.limits = limits
        self.poll_seconds = poll_seconds
        self.completion_window = completion_window
        self.metadata = metadata

    def run(self, bodies: dict[str, dict], desc: str) -> dict[str, dict]:
        """The response body of every request, by ``custom_id``; raises ``EvalRequestFailed``
        when any of them has none. A run that stops early (a failure, Ctrl-C) cancels the batches
        it left running."""
        if not bodies:
            return {}
        lines = [encode_line(custom_id, body) for custom_id, body in bodies.items()]
        ids = list(bodies)
        files: dict[str, list[str]] = {}  # batch id -> the custom_ids of its lines, in order
        results: dict[str, dict] = {}
        ended: set[str] = set()
        try:
            for data in split_files(lines, self.limits):
                count = data.count(b"\n")
                files[self._create(data)] = ids[:count]
                ids = ids[count:]
            self._follow(files, len(lines), desc, results, ended)
        except BaseException:
            self._cancel([batch_id for batch_id in files if batch_id not in ended])
            raise
        missing = [custom_id for custom_id in bodies if custom_id not in results]
        if missing:
            raise EvalRequestFailed(missing[0], f"no result in the output of its batch ({len(missing)} missing)")
        return results

    def _create(self, data: bytes) -> str:
        from openai import APIStatusError

        extra = {"metadata": self.metadata} if self.metadata else {}
        try:
            uploaded = self.client.files.create(file=("eval.jsonl", io.BytesIO(data)), purpose="batch")
            batch = self.client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT,
                                               completion_window=self.completion_window, **extra)
        except APIStatusError as refused:  # the file or the batch refused whole (a model not served, ...)
            error = refused.body if isinstance(refused.body, dict) else {}
            raise EvalRequestFailed(None, f"{error.get('code') or refused.status_code}: "
                                          f"{error.get('message') or refused.message}") from refused
        logger.info("batch %s: %d bytes in %s", batch.id, len(data), uploaded.id)
        return batch.id

    def _follow(self, files: dict[str, list[str]], total: int, desc: str, results: dict[str, dict],
                ended: set[str]) -> None:
        """Poll until every batch has ended (``ended``), collecting each as it ends: the first one
        without a result for every request raises at once. The waits between polls start at
        ``FIRST_POLL_SECONDS`` and double up to ``poll_seconds``."""
        done_of: dict[str, int] = {}
        wait = min(FIRST_POLL_SECONDS, self.poll_seconds)
        with tqdm(total=total, desc=desc) as bar:
            while True:
                for batch_id, custom_ids in files.items():
                    if batch_id in ended:
                        continue
                    batch = self.client.batches.retrieve(batch_id)
                    counts = batch.request_counts
                    done_of[batch_id] = (counts.completed + counts.failed) if counts else 0
                    if batch.status in TERMINAL:
                        ended.add(batch_id)
                        self._collect(batch, custom_ids, results)
                        done_of[batch_id] = len(custom_ids)
                bar.update(sum(done_of.values()) - bar.n)
                if len(ended) == len(files):
                    return
                time.sleep(wait)
                wait = min(wait * 2, self.poll_seconds)

    def _cancel(self, batch_ids: list[str]) -> None:
        from openai import OpenAIError

        for batch_id in batch_ids:
            try:
                self.client.batches.cancel(batch_id)
                logger.warning("cancelled batch %s: the evaluation stopped", batch_id)
            except OpenAIError as error:  # it ends on its own; the evaluation's own error matters more
                logger.warning("could not cancel batch %s: %s", batch_id, error)

    def _collect(self, batch, custom_ids: list[str], results: dict[str, dict]) -> None:
        if batch.status == "failed":  # the file was refused, at the first bad line if it names one: nothing ran
            errors = batch.errors.data if batch.errors and batch.errors.data else []
            first = errors[0] if errors else None
            line = getattr(first, "line", None)
            custom_id = custom_ids[line - 1] if line and 0 < line <= len(custom_ids) else None
            detail = f"{first.code}: {first.message}" if first else "no detail"
            raise EvalRequestFailed(custom_id, f"{detail} (batch {batch.id} failed validation)")
        if batch.error_file_id:
            for record in self._records(batch.error_file_id):
                raise EvalRequestFailed(record.get("custom_id"), f"{error_text(record)} (batch {batch.id})")
        if batch.status != "completed":
            raise EvalRequestFailed(None, f"batch {batch.id} ended {batch.status}")
        for record in self._records(batch.output_file_id) if batch.output_file_id else ():
            results[record["custom_id"]] = record["response"]["body"]

    def _records(self, file_id: str) -> Iterator[dict]:
        for raw in self.client.files.content(file_id).text.splitlines():
            if raw.strip():
                yield json.loads(raw)

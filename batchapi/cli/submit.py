"""``batchapi submit FILE --wait``: a client for people, on the official ``openai`` SDK.

Uploads the file, creates the batch and, with ``--wait``, follows it with a progress bar
(requests done, output tokens/s, ETA), then prints a few results and what the batch cost.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from batchapi.cli.client import client_for
from batchapi.cli.failures import CommandError

TERMINAL = {"completed", "failed", "expired", "cancelled"}
POLL_SECONDS = 1.0


def _first_url(path: Path) -> str:
    """The endpoint of the file's first request, read before anything is uploaded."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if raw.strip():
                try:
                    return json.loads(raw)["url"]
                except (ValueError, TypeError, KeyError):
                    raise CommandError(f"{path}: line {number} is not a batch request line with a \"url\"; "
                                       "give a JSONL batch file, or the endpoint with --endpoint") from None
    raise CommandError(f"{path} holds no requests; give a JSONL batch file, one request a line")


def submit(
    path: Path, *, base_url: str, api_key: str | None, endpoint: str | None, wait: bool, show: int,
    console: Console,
) -> int:
    endpoint = endpoint or _first_url(path)
    client = client_for(base_url, api_key)
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    console.print(f"uploaded {uploaded.id} ({uploaded.bytes} bytes); batch [bold]{batch.id}[/bold]",
                  soft_wrap=True)
    if not wait:
        return 0
    batch = follow(client, batch.id, console)
    _report(client, batch, show, console)
    return 0 if batch.status == "completed" else 1


def follow(client, batch_id: str, console: Console):
    columns = (
        TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:.0f} tok/s"), TimeRemainingColumn(),
    )
    start = time.monotonic()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("batch", total=None, status="validating", rate=0.0)
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            tokens = (batch.usage.output_tokens if getattr(batch, "usage", None) else 0) or 0
            rate = tokens / max(time.monotonic() - start, 1e-6)
            total = counts.total if counts and counts.total else None
            progress.update(task, completed=done, total=total, status=batch.status, rate=rate)
            if batch.status in TERMINAL:
                return batch
            time.sleep(POLL_SECONDS)


def _report(client, batch, show: int, console: Console) -> None:
    counts = batch.request_counts
    console.print(f"batch {batch.id}: [bold]{batch.status}[/bold]"
                  + (f", {counts.completed} completed, {counts.failed} failed" if counts else ""))
    if batch.errors and batch.errors.data:
        for err in batch.errors.data[:show]:
            console.print(f"  line {err.line}: {err.code}: {err.message}")
    refused = (batch.model_extra or {}).get("request_errors")
    if refused:  # requests refused alone (a 400 line each in the error file); the rest ran
        console.print(f"{refused['total']} request(s) refused:")
        for err in refused["data"][:show]:
            console.print(f"  line {err['line']}: {err['code']}: {err['message']}", soft_wrap=True)
    if batch.output_file_id:
        lines = client.files.content(batch.output_file_id).text.splitlines()
        # spread over the file, so a mixed batch shows each kind of request
        for raw in lines[:: max(1, len(lines) // max(show, 1))][:show]:
            record = json.loads(raw)
            console.print(f"  [cyan]{record['custom_id']}[/cyan]: {_answer(record['response']['body'])!r}",
                          soft_wrap=True)
    usage = getattr(batch, "usage", None)
    if usage:
        console.print(f"usage: {usage.input_tokens} input ({usage.input_tokens_details.cached_tokens} cached), "
                      f"{usage.output_tokens} output tokens")
    cost = (batch.model_extra or {}).get("cost")
    if cost:
        console.print(f"cost: {cost['amount']} {cost['currency']} (list price {cost['list_amount']})")


def _answer(body: dict) -> str:
    choice = body["choices"][0]
    if "message" not in choice:
        return choice["text"]
    calls = choice["message"].get("tool_calls")
    if calls:
        return "; ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls)
    return choice["message"]["content"]

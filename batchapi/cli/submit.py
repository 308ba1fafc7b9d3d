"""``batchapi submit FILE --wait``: a client for people, on the official ``openai`` SDK.

Uploads the file, creates the batch and, with ``--wait``, follows it with a progress bar
(requests done, output tokens/s, time left at the rate seen, and the server's estimated
completion under the fair share), then prints a few results and what the batch cost. With
``--dry-run`` it uploads the file and shows the server's dry run instead of creating a batch.
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
    console: Console, priority: int = 0, max_cost: str | None = None, dry_run: bool = False,
) -> int:
    endpoint = endpoint or _first_url(path)
    client = client_for(base_url, api_key)
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    if dry_run:
        return _dry_run(client, uploaded.id, endpoint, priority, show, console)
    extra = {name: value for name, value in (("priority", priority), ("max_cost", max_cost)) if value}
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                  extra_body=extra or None)
    console.print(f"uploaded {uploaded.id} ({uploaded.bytes} bytes); batch [bold]{batch.id}[/bold]",
                  soft_wrap=True)
    if not wait:
        return 0
    batch = follow(client, batch.id, console)
    _report(client, batch, show, console)
    return 0 if batch.status == "completed" else 1


def _dry_run(client, file_id: str, endpoint: str, priority: int, show: int, console: Console) -> int:
    """The server's dry run of the uploaded file; exit 1 when a batch of it would fail."""
    run = client.post("/batches/dry_run", cast_to=object, body={
        "input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", "priority": priority})
    if not run["valid"]:
        console.print(f"a batch of {file_id} would [bold]fail[/bold]:")
        for err in run["errors"]["data"][:show]:
            console.print(f"  line {err['line']}: {err['code']}: {err['message']}", soft_wrap=True)
        return 1
    cost, eta = run["estimated_cost"], run["estimated_completion_at"]
    console.print(f"{run['request_counts']['total']} requests on {run['model']}: {run['prompt_tokens']} prompt tokens "
                  f"(exact), at most {run['max_output_tokens']} output tokens")
    console.print(f"estimated cost: at most {cost['amount']} {cost['currency']} (list price {cost['list_amount']})")
    console.print("estimated completion: " + (_clock(eta) if eta else "unknown (the fleet has no measured rate yet)"))
    refused = run.get("request_errors")
    if refused:
        console.print(f"{refused['total']} request(s) would be refused alone (a 400 each), e.g. line "
                      f"{refused['data'][0]['line']}: {refused['data'][0]['message']}", soft_wrap=True)
    if run["quota"]:
        console.print(f"[bold]over quota[/bold] ({run['enqueued_tokens']} enqueued tokens as it starts): "
                      f"{run['quota']['code']}: {run['quota']['message']}", soft_wrap=True)
        return 1
    return 0


def _clock(timestamp: int) -> str:
    left = max(timestamp - time.time(), 0)
    return time.strftime("%H:%M:%S", time.localtime(timestamp)) + f" (in {left / 60:.0f} min)"


def follow(client, batch_id: str, console: Console):
    columns = (
        TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:.0f} tok/s"), TimeRemainingColumn(), TextColumn("{task.fields[eta]}"),
    )
    start = time.monotonic()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("batch", total=None, status="validating", rate=0.0, eta="")
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            tokens = (batch.usage.output_tokens if getattr(batch, "usage", None) else 0) or 0
            rate = tokens / max(time.monotonic() - start, 1e-6)
            total = counts.total if counts and counts.total else None
            eta = (batch.model_extra or {}).get("estimated_completion_at")  # the server's plan
            risk = " (served first: at risk of its window)" if (batch.model_extra or {}).get("deadline_risk_at") else ""
            progress.update(task, completed=done, total=total, status=batch.status, rate=rate,
                            eta=f"done by {time.strftime('%H:%M:%S', time.localtime(eta))}{risk}" if eta else "")
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

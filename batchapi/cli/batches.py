"""``batchapi batches list | show | cancel | download | retry``: batches for people, over HTTP.

Like ``submit``, on the official ``openai`` SDK against a running server: tables for the
batches, and ``--wait`` follows a batch with ``submit --wait``'s progress view. ``retry`` posts
to the ``/v1/batches/{id}/retry`` extension.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from batchapi.cli.client import client_for
from batchapi.cli.failures import CommandError
from batchapi.cli.submit import TERMINAL, follow

TIMES = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at", "expires_at")


def _when(timestamp: int | None, short: bool = False) -> str:
    if timestamp is None:
        return ""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S UTC")


def _counts(batch) -> str:
    counts = batch.request_counts
    if counts is None:
        return ""
    return f"{counts.completed + counts.failed}/{counts.total}"


def list_batches(client, limit: int, console: Console) -> int:
    """The newest ``limit`` batches, newest first, in 80 columns: ids whole, to copy into the
    other commands (``show`` tells the endpoint and what a retry retries)."""
    table = Table(box=None, pad_edge=False)
    table.add_column("id", no_wrap=True)
    for name in ("status", "done", "failed", "created"):
        table.add_column(name, no_wrap=True)
    for batch in client.batches.list(limit=limit).data:
        counts = batch.request_counts
        table.add_row(batch.id, batch.status, _counts(batch), str(counts.failed if counts else ""),
                      _when(batch.created_at, short=True))
    console.print(table)
    return 0


def show(client, batch_id: str, wait: bool, console: Console) -> int:
    batch = follow(client, batch_id, console) if wait else client.batches.retrieve(batch_id)
    console.print(details(batch))
    return 0


def details(batch) -> Table:
    """Every field people look at, one a row."""
    extra = batch.model_extra or {}
    table = Table("field", "value", box=None, pad_edge=False, show_header=False)
    rows = [("id", batch.id), ("status", batch.status), ("endpoint", batch.endpoint),
            ("model", getattr(batch, "model", None) or ""), ("input file", batch.input_file_id),
            ("output file", batch.output_file_id or ""), ("error file", batch.error_file_id or "")]
    counts = batch.request_counts
    if counts:
        rows.append(("requests", f"{counts.total} total, {counts.completed} completed, {counts.failed} failed"))
    usage = getattr(batch, "usage", None)
    if usage:
        rows.append(("usage", f"{usage.input_tokens} input ({usage.input_tokens_details.cached_tokens} cached), "
                              f"{usage.output_tokens} output tokens"))
    for name in ("cost", "estimated_cost"):
        if extra.get(name):
            rows.append((name.replace("_", " "), f"{extra[name]['amount']} {extra[name]['currency']} "
                                                 f"(list price {extra[name]['list_amount']})"))
    rows += [(name.removesuffix("_at").replace("_", " "), _when(getattr(batch, name))) for name in TIMES
             if getattr(batch, name, None) is not None]
    if extra.get("retry_of"):
        rows.append(("retry of", extra["retry_of"]))
    if batch.metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in batch.metadata.items())))
    if batch.errors and batch.errors.data:
        rows += [("error", f"line {e.line}: {e.code}: {e.message}") for e in batch.errors.data[:5]]
    for name, value in rows:
        table.add_row(f"[bold]{name}[/bold]", str(value))
    return table


def cancel(client, batch_id: str, wait: bool, console: Console) -> int:
    batch = client.batches.cancel(batch_id)
    console.print(f"batch {batch.id}: [bold]{batch.status}[/bold]")
    if wait:
        batch = follow(client, batch_id, console)
        console.print(details(batch))
    return 0


def download(client, batch_id: str, directory: Path, console: Console) -> int:
    """The batch's output and error files into ``directory``, under their file names."""
    batch = client.batches.retrieve(batch_id)
    files = [f for f in (batch.output_file_id, batch.error_file_id) if f]
    if not files:
        ended = batch.status in TERMINAL
        raise CommandError(f"batch {batch.id} ({batch.status}) has no output or error file"
                           + ("" if ended else f" yet; `batchapi batches show {batch.id} --wait` follows it"))
    directory.mkdir(parents=True, exist_ok=True)
    for file_id in files:
        name = Path(client.files.retrieve(file_id).filename).name or f"{file_id}.jsonl"
        path = directory / name
        lines = 0
        with client.files.with_streaming_response.content(file_id) as response, path.open("wb") as out:
            for chunk in response.iter_bytes():
                out.write(chunk)
                lines += chunk.count(b"\n")
        console.print(f"{path}: {lines} lines")
    return 0


def retry(client, batch_id: str, idempotency_key: str | None, wait: bool, console: Console) -> int:
    from openai.types import Batch

    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    batch = client.post(f"/batches/{batch_id}/retry", cast_to=Batch, body={}, options={"headers": headers})
    console.print(f"batch [bold]{batch.id}[/bold] retries the failed, expired and cancelled requests of {batch_id}",
                  soft_wrap=True)
    if not wait:
        return 0
    batch = follow(client, batch.id, console)
    console.print(details(batch))
    return 0 if batch.status == "completed" else 1


def run(action: str, args, base_url: str, console: Console) -> int:
    """One ``batchapi batches ACTION``; an API error reaches ``batchapi.cli.commands.main``."""
    client = client_for(base_url, args.api_key)
    if action == "list":
        return list_batches(client, args.limit, console)
    if action == "show":
        return show(client, args.batch_id, args.wait, console)
    if action == "cancel":
        return cancel(client, args.batch_id, args.wait, console)
    if action == "download":
        return download(client, args.batch_id, Path(args.output_dir), console)
    assert action == "retry", f"unknown action {action}"
    return retry(client, args.batch_id, args.idempotency_key, args.wait, console)

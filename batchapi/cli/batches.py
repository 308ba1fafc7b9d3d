"""``batchapi batches list | show | cancel | download | retry | diff``: batches for people, over HTTP.

Like ``submit``, on the official ``openai`` SDK against a running server: tables for the
batches, and ``--wait`` follows a batch with ``submit --wait``'s progress view. ``retry`` posts
to the ``/v1/batches/{id}/retry`` extension, ``diff`` reads ``/v1/batches/{id}/diff``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from batchapi.cli.client import client_for
from batchapi.cli.failures import CommandError, explain
from batchapi.cli.submit import TERMINAL, follow

# `batches diff`'s exit statuses beyond 0 (no output changed under the same system_fingerprint)
REPRODUCIBILITY_BREAK = 3
DIFF_FAILED = 4  # the diff could not be made: a batch not ended or not found, its files gone, no server
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
    if extra.get("priority"):
        rows.append(("priority", extra["priority"]))
    if extra.get("max_cost"):
        rows.append(("max cost", f"{extra['max_cost']} {(extra.get('cost') or {}).get('currency', '')}"))
    if extra.get("estimated_completion_at"):
        rows.append(("estimated completion", _when(extra["estimated_completion_at"])))
    if extra.get("deadline_risk_at"):
        rows.append(("deadline risk", f"since {_when(extra['deadline_risk_at'])}: served before other batches"))
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


def diff(client, batch_id: str, against: str, limit: int, as_json: bool, console: Console) -> int:
    """The requests whose results differ between two ended batches; exits ``REPRODUCIBILITY_BREAK``
    when an output changed under the same system_fingerprint, ``DIFF_FAILED`` when no diff came."""
    import openai

    try:
        found = client.get(f"/batches/{batch_id}/diff", cast_to=object,
                           options={"params": {"against": against, "limit": limit}})
    except openai.APIError as exc:
        failure = CommandError(explain(exc, str(client.base_url).rstrip("/")).line)
        failure.status = DIFF_FAILED
        raise failure from None
    if as_json:
        print(json.dumps(found, indent=2, ensure_ascii=False))
    else:
        _print_diff(found, console)
    return 0 if found["reproducible"] else REPRODUCIBILITY_BREAK


def _print_diff(found: dict, console: Console) -> None:
    s = found["summary"]
    console.print(f"[bold]{found['batch_id']}[/bold] -> [bold]{found['against']}[/bold] ({found['endpoint']})",
                  soft_wrap=True)
    prints = found["system_fingerprints"]
    table = Table("what", "count", box=None, pad_edge=False, show_header=False)
    rows = [("requests", f"{s['batch_requests']} -> {s['against_requests']} ({s['compared']} in both)"),
            ("identical", s["identical"]),
            ("output changed", f"{s['output_changed']} ({s['reproducibility_breaks']} under the same fingerprint)"),
            ("succeeded <-> failed", s["status_changed"]), ("other error", s["error_changed"]),
            ("only in the first", s["only_in_batch"]), ("only in the second", s["only_in_against"]),
            ("token counts only", s["usage_changed"]),
            ("tokens", f"prompt {s['prompt_tokens_delta']:+d}, completion {s['completion_tokens_delta']:+d}"),
            ("fingerprints", f"{', '.join(prints['batch']) or '-'} -> {', '.join(prints['against']) or '-'}")]
    if not found["inputs_compared"]:
        rows.append(("inputs", "not compared (an input file is gone)"))
    for name, value in rows:
        table.add_row(f"[bold]{name}[/bold]", str(value))
    console.print(table)
    if found["data"]:
        console.print(_changes(found["data"]))
    if found["has_more"]:
        console.print(f"(the first {len(found['data'])} listed; --limit lists more)")
    if found["reproducible"]:
        console.print("reproducible: no output changed under the same system_fingerprint")
    else:
        console.print(f"[bold red]reproducibility break[/bold red]: {s['reproducibility_breaks']} request(s) "
                      "changed output under the same system_fingerprint", soft_wrap=True)


def _changes(data: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False)
    table.add_column("custom_id", overflow="fold")
    for name in ("change", "fingerprint", "tokens"):
        table.add_column(name, no_wrap=True)
    table.add_column("first", overflow="fold")
    table.add_column("second", overflow="fold")
    same = {True: "same", False: "differs", None: "-"}
    for d in data:
        change = "BREAK" if d["reproducibility_break"] else d["change"]
        tokens = ("-" if d["prompt_tokens_delta"] is None
                  else f"{d['prompt_tokens_delta']:+d}/{d['completion_tokens_delta']:+d}")
        sides = [_short(d[side]["output"]) if d[side] else "(absent)" for side in ("batch", "against")]
        table.add_row(d["custom_id"], change, same[d["same_fingerprint"]], tokens, *sides)
    return table


def _short(text: str, size: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= size else text[: size - 1] + "…"


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
    if action == "diff":
        return diff(client, args.batch_id, args.against, args.limit, args.json, console)
    assert action == "retry", f"unknown action {action}"
    return retry(client, args.batch_id, args.idempotency_key, args.wait, console)

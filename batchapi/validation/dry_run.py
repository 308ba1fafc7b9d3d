"""A dry run of a file (``POST /v1/batches/dry_run``): what a batch of it would meet, without one.

The file is scanned as validation scans it (its line errors and refused bodies), then every
prompt is tokenized as the background count does, so the prompt tokens are exact; the cost is
that of those tokens and the max_tokens bound at the price in force; the completion is where
the plan (``fair_share``) puts a batch of that work behind what is queued now, at the fleet's
measured rate; and the quota check says whether it would start, on the tokens the start counts
(validation's bounds, not the exact prompts). Nothing is written.

A dry run reads and tokenizes the whole file on an API thread, so each project runs one at a
time in each API process (a second one meanwhile is a 429), and one project's dry runs cannot
take every thread from the others.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from batchapi.batches.billing import Cost, discounted, list_amount, price_for
from batchapi.batches.files import get_file_row
from batchapi.batches.service import batch_models, check_scheduling, window_seconds
from batchapi.batches.sharing import fair_share, quotas
from batchapi.context import Context
from batchapi.errors import InvalidRequest, RateLimited
from batchapi.models.registry import served_model
from batchapi.openai.body import ENDPOINTS, MESSAGES
from batchapi.validation.backfill import count_shard
from batchapi.validation.runner import scan_file
from batchapi.validation.scanner import LineError, ScanResult
from batchapi.validation.token_counts import counter_for

_running: set[str] = set()
_lock = threading.Lock()


@dataclass(frozen=True)
class DryRun:
    input_file_id: str
    endpoint: str
    completion_window: str
    model: str | None
    errors: list[LineError]  # problems of the file: a batch of it would fail
    request_errors: dict | None  # bodies a batch of it would answer with a 400
    request_total: int
    prompt_tokens: int  # exact
    max_output_tokens: int  # the max_tokens bound
    enqueued_tokens: int  # what a quota counts as it starts: validation's prompt and max_tokens bounds
    estimated_cost: Cost | None
    estimated_completion_at: int | None  # None: the fleet has no measured rate yet
    fleet_rate: float | None  # estimated tokens per second
    quota: tuple[str, str] | None  # the code and message that would fail it as it starts


def dry_run(ctx: Context, project_id: str, input_file_id: str, endpoint: str, completion_window: str,
            priority: int = 0) -> DryRun:
    if endpoint not in ENDPOINTS or endpoint == MESSAGES:
        raise InvalidRequest(f"endpoint {endpoint!r} is not supported; expected one of "
                             f"{[e for e in ENDPOINTS if e != MESSAGES]}", "endpoint")
    seconds = window_seconds(completion_window)
    check_scheduling(priority, None)
    with _lock:
        if project_id in _running:
            raise RateLimited("A dry run of this project is running; try again when it has finished.")
        _running.add(project_id)
    try:
        return _run(ctx, project_id, input_file_id, endpoint, completion_window, seconds, priority)
    finally:
        with _lock:
            _running.discard(project_id)


def _run(ctx: Context, project_id: str, input_file_id: str, endpoint: str, window: str, seconds: int,
         priority: int) -> DryRun:
    with ctx.sessions() as session:
        file = get_file_row(session, project_id, input_file_id)
        if file.purpose != "batch":
            raise InvalidRequest(f"file {input_file_id} has purpose {file.purpose!r}, not 'batch'", "input_file_id")
    models = batch_models(ctx, project_id, input_file_id)
    model = models[0] if models else None
    result = scan_file(ctx, file, input_file_id, endpoint, model, [])
    if isinstance(result, list) or result.errors:
        errors = result if isinstance(result, list) else result.errors
        report = None if isinstance(result, list) else result.request_report
        return DryRun(input_file_id, endpoint, window, model, errors, report, 0, 0, 0, 0, None, None, None, None)
    prompt, output = _exact(ctx, file.storage_key, endpoint, result)
    price = price_for(ctx.settings, result.model)
    full = list_amount(price, prompt, 0, output)
    cost = Cost(price.currency, discounted(full, ctx.settings.batch_discount_percent), full)
    t = time.time()
    with ctx.sessions() as session:
        # the quota counts what the start counts: validation's bounds, not the exact prompts
        enqueued = result.enqueued()
        over = quotas.refusal(session, ctx.settings, project_id, "", enqueued, lock=False)
        rate = fair_share.fleet_rate(session, t, ctx.settings.fair_share_window_seconds)
        eta = None
        if rate is not None:
            mine = fair_share.Queued("", project_id, float(prompt + output), priority, int(t), int(t) + seconds, False)
            batches, weights = fair_share.queued(session, [mine])
            eta = round(fair_share.finish_times(batches, weights, rate, t)[""])
    return DryRun(input_file_id, endpoint, window, result.model, [], result.request_report, result.request_count,
                  prompt, output, sum(enqueued.values()), cost, eta, rate, (str(over[0]), over[1]) if over else None)


def _exact(ctx: Context, key: str, endpoint: str, result: ScanResult) -> tuple[int, int]:
    """Every prompt tokenized: the exact prompt tokens and the max_tokens bound."""
    served = served_model(ctx.settings, result.model)
    counter = counter_for(served.path)
    prompt = output = 0
    for plan in result.shards:
        counts, outputs = count_shard(ctx, counter, served.aliases, endpoint, key, plan)
        prompt += sum(counts)
        output += outputs
    return prompt, output

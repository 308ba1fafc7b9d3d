"""`batchapi run-batch`: an OpenAI batch JSONL file through the engine, with no server.

Both files stream: lines are read as the engine has room for them (a bounded number of
requests in flight) and results are written as they finish, so memory stays flat however long
the input. Output lines are in the OpenAI batch output shape, in completion order; a line that
cannot run becomes a status-400 line with an OpenAI error body.
"""

from __future__ import annotations

import json
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from batchapi.engine import EngineConfig, EngineFront, GenerationResult
from batchapi.jobs.request_body import ENDPOINTS, BodyError, ParsedBody, parse_body
from batchapi.workers import openai_io, result_lines


@dataclass
class BatchCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0

    @property
    def output_tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0


def parse_line(content: str) -> tuple[str | None, ParsedBody]:
    """(custom_id, body) of one input line; raises BodyError with what is wrong."""
    try:
        record = json.loads(content)
    except json.JSONDecodeError as exc:
        raise BodyError(f"the line is not valid JSON: {exc.msg}", None, "invalid_json") from None
    if not isinstance(record, dict):
        raise BodyError("the line must be a JSON object", None, "invalid_type")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BodyError("'custom_id' is required and must be a string", "custom_id", "missing_required_parameter")
    if record.get("method", "POST") != "POST":
        raise BodyError("'method' must be POST", "method")
    url = record.get("url")
    if url not in ENDPOINTS:
        raise BodyError(f"unsupported url {url!r}; expected one of {list(ENDPOINTS)}", "url")
    try:
        return custom_id, parse_body(url, record.get("body"))
    except BodyError as exc:
        exc.custom_id = custom_id
        raise


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class _Writer:
    def __init__(self, out, counts: BatchCounts, front: EngineFront, model: str):
        self.out, self.counts, self.front, self.model = out, counts, front, model
        self.bodies: dict[str, tuple[str, ParsedBody]] = {}  # in-flight request id -> (custom_id, body)

    def error(self, custom_id: str | None, exc: BodyError) -> None:
        self.out.write(result_lines.rejected(custom_id, exc.message, exc.param, exc.code).decode())
        self.counts.failed += 1

    def finished(self, request_id: str, future: Future) -> None:
        if future.exception() is not None:  # the engine failed, not the request: report, go on
            custom_id, _ = self.bodies.pop(request_id)
            self.error(custom_id, BodyError(f"the engine failed: {future.exception()}", None, "server_error"))
            return
        self.result(future.result())

    def result(self, result: GenerationResult) -> None:
        custom_id, parsed = self.bodies.pop(result.request_id)
        if result.error is not None:
            body = openai_io.error_body(result)["error"]
            self.out.write(result_lines.rejected(custom_id, body["message"], body["param"], body["code"]).decode())
            self.counts.failed += 1
            return
        body = openai_io.to_body(parsed, result, self.model, self.front.tokenizer)
        self.out.write(result_lines.succeeded(custom_id, body).decode())
        self.counts.completed += 1
        self.counts.prompt_tokens += result.prompt_tokens
        self.counts.completion_tokens += result.completion_tokens
        self.counts.cached_tokens += result.cached_tokens


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[tps]:>8.1f} tok/s"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        disable=not enabled,
    )


def run_batch(input_path: Path, output_path: Path, engine_config: EngineConfig | None = None, progress: bool = True,
              front: EngineFront | None = None, max_in_flight: int | None = None) -> BatchCounts:
    """Run every line of ``input_path`` and write one output line each to ``output_path``."""
    own_front = front is None
    if own_front:
        assert engine_config is not None, "pass an engine_config or a started front"
        front = EngineFront(engine_config).start()
    limit = max_in_flight or 2 * front.config.max_num_seqs + 64
    counts = BatchCounts(total=count_lines(Path(input_path)))
    done: queue.Queue[tuple[str, Future]] = queue.Queue()
    started = time.monotonic()
    try:
        with open(input_path, encoding="utf-8") as src, open(output_path, "w", encoding="utf-8") as out, \
                _progress(progress) as bar:
            writer = _Writer(out, counts, front, Path(front.config.model_path).name)
            task = bar.add_task("run", total=counts.total, tps=0.0)

            def drain(block: bool) -> None:
                while True:
                    try:
                        request_id, future = done.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        return
                    writer.finished(request_id, future)
                    block = False
                    elapsed = time.monotonic() - started
                    bar.update(task, completed=counts.completed + counts.failed,
                               tps=counts.completion_tokens / elapsed if elapsed else 0.0)

            for number, content in enumerate(src, start=1):
                if not content.strip():
                    continue
                try:
                    custom_id, parsed = parse_line(content)
                    request = openai_io.to_request(parsed, front.tokenizer, f"line-{number}")
                except (BodyError, ValueError) as exc:
                    exc = exc if isinstance(exc, BodyError) else BodyError(str(exc))
                    writer.error(getattr(exc, "custom_id", None), exc)
                    bar.update(task, completed=counts.completed + counts.failed)
                    continue
                writer.bodies[request.request_id] = (custom_id, parsed)
                future = front.submit(request)
                future.add_done_callback(lambda f, rid=request.request_id: done.put((rid, f)))
                while len(writer.bodies) >= limit:
                    drain(block=True)
                drain(block=False)
            while writer.bodies:
                drain(block=True)
    finally:
        if own_front:
            front.shutdown()
    counts.seconds = time.monotonic() - started
    return counts

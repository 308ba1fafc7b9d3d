"""`batchapi run-batch`: an OpenAI batch JSONL file through the engine, with no server.

Both files stream: lines are read as the engine has room for them (a bounded number of
requests in flight) and results are written as soon as every line before them is written, so
memory stays flat however long the input. Lines are parsed by ``openai.lines`` and rendered by
``Codec``, as in the service: one output line per input line, in input order, in the OpenAI
batch output shape, with the line's ``custom_id`` wherever the line got as far as naming one; a
line that cannot run (a bad line, or a body refused as validation refuses it) becomes a
status-400 line with an OpenAI error body, with the codes validation gives.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from batchapi.engine.config import EngineConfig
from batchapi.engine.core import EngineProcess, start_engine
from batchapi.engine.request import GenerationResult
from batchapi.models.registry import context_length
from batchapi.openai.embeddings import EMBEDDINGS
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import InputLine, is_blank, iter_lines, parse_line
from batchapi.storage.streams import CHUNK
from batchapi.workers.codec import Codec

if TYPE_CHECKING:
    from batchapi.engine.front import EngineFront

WINDOW = 4  # lines waiting to be written, in multiples of the requests in flight
SEND_EVERY = 32  # requests read before they go to the engine together (and whenever reading must wait)


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


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(CHUNK), b"")


def count_lines(path: Path, max_line_bytes: int | None = None) -> int:
    return sum(1 for _, _, _, content in iter_lines(_chunks(path), max_line_bytes) if not is_blank(content))


class _Writer:
    """Writes each line's result in input order: a result that finishes before an earlier line's
    waits in ``ready`` until its turn."""

    def __init__(self, out, counts: BatchCounts, codec: Codec):
        self.out, self.counts, self.codec = out, counts, codec
        self.lines: dict[str, InputLine] = {}  # in-flight request id -> its line
        self.unwritten: deque[int] = deque()  # line numbers read and not written yet, in input order
        self.ready: dict[int, bytes] = {}  # line number -> its rendered result, waiting for its turn

    def expect(self, line: InputLine) -> None:
        self.unwritten.append(line.line)

    def write(self, line: InputLine, result: GenerationResult | None) -> None:
        rendered, ok = self.codec.line(line, result, ErrorCode.SERVER_ERROR)
        self.ready[line.line] = rendered
        while self.unwritten and self.unwritten[0] in self.ready:
            self.out.write(self.ready.pop(self.unwritten.popleft()))
        if not ok:
            self.counts.failed += 1
            return
        self.counts.completed += 1
        self.counts.prompt_tokens += result.prompt_tokens
        self.counts.completion_tokens += result.completion_tokens
        self.counts.cached_tokens += result.cached_tokens

    def finished(self, request_id: str, future: Future) -> None:
        line = self.lines.pop(request_id)
        if future.exception() is not None:  # the engine failed, not the request: report, go on
            line.error = RequestError(f"the engine failed: {future.exception()}", None, ErrorCode.SERVER_ERROR)
            self.write(line, None)
            return
        self.write(line, future.result())


def _embeddings_line(line: InputLine) -> bool:
    """A line for ``/v1/embeddings``, even one whose body was refused (its url is the first problem)."""
    if line.body is not None:
        return line.body.endpoint == EMBEDDINGS
    return line.error is not None and line.error.in_body and line.url == EMBEDDINGS


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[tps]:>8.1f} tok/s"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        disable=not enabled,
    )


def run_batch(input_path: Path, output_path: Path, engine_config: EngineConfig | None = None, progress: bool = True,
              front: EngineFront | EngineProcess | None = None, max_in_flight: int | None = None,
              max_line_bytes: int | None = None, engine_process: bool = True) -> BatchCounts:
    """Run every line of ``input_path`` and write one output line each to ``output_path``, in
    input order; a line over ``max_line_bytes`` is refused (``line_too_long``) without being read
    into memory. At most ``max_in_flight`` requests are in the engine, and at most
    ``WINDOW`` times that many lines wait behind a slow one before reading stops. Without a
    ``front``, one is started for the run: the engine core in a child process, or with
    ``engine_process`` false on a thread of this one."""
    own_front = front is None
    if own_front:
        assert engine_config is not None, "pass an engine_config or a started front"
        front = start_engine(engine_config, process=engine_process)
    limit = max_in_flight or 2 * front.config.max_num_seqs + 64
    counts = BatchCounts(total=count_lines(Path(input_path), max_line_bytes))
    done: queue.Queue[tuple[str, Future]] = queue.Queue()
    started = time.monotonic()
    try:
        with open(output_path, "wb") as out, _progress(progress) as bar:
            codec = Codec(front.tokenizer, Path(front.config.model_path).name, front.system_fingerprint,
                          context=context_length(front.config.model_path))
            writer = _Writer(out, counts, codec)
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

            staged: list = []  # requests read and not yet sent: the engine takes them in one message

            def send() -> None:
                for request, future in zip(staged, front.submit_many(staged), strict=True):
                    future.add_done_callback(lambda f, rid=request.request_id: done.put((rid, f)))
                staged.clear()

            for number, _, _, content in iter_lines(_chunks(Path(input_path)), max_line_bytes):
                if is_blank(content):
                    continue
                line = parse_line(content, number, None)
                if _embeddings_line(line):  # run-batch runs a chat model
                    line.body, line.error = None, RequestError(
                        f"run-batch runs a chat model; {EMBEDDINGS} lines need `batchapi serve`", "url",
                        ErrorCode.INVALID_URL, in_body=False, custom_id=line.custom_id)
                writer.expect(line)
                if line.error is None:
                    try:
                        request = writer.codec.request(line, f"line-{number}")
                    except RequestError as exc:  # a request that cannot fit the context
                        exc.custom_id = line.custom_id
                        line.error = exc
                    except ValueError as exc:  # sampling settings the engine refuses
                        line.error = RequestError(str(exc), custom_id=line.custom_id)
                if line.error is not None:
                    writer.write(line, None)
                    bar.update(task, completed=counts.completed + counts.failed)
                    continue
                writer.lines[request.request_id] = line
                staged.append(request)
                if len(staged) >= SEND_EVERY:
                    send()
                while len(writer.lines) >= limit or len(writer.unwritten) >= WINDOW * limit:
                    send()
                    drain(block=True)  # the oldest unwritten line is in flight, so a result comes
                drain(block=False)
            send()
            while writer.lines:
                drain(block=True)
    finally:
        if own_front:
            front.shutdown()
    counts.seconds = time.monotonic() - started
    return counts

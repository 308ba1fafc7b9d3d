"""Validation of a batch's input file: one streaming pass, every problem with its line number.

``scan`` reads the file in chunks, checks each line (JSON object, ``custom_id``, method, url,
model, body), counts prompt tokens in batches and cuts the valid requests into shards. It
touches no database: ``validation_runner`` claims the batch, calls it and records the outcome.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from batchapi.jobs.prompt_tokens import PromptCounter
from batchapi.jobs.request_body import BodyError, ParsedBody, parse_body

MAX_REPORTED_ERRORS = 100
MAX_MESSAGE = 300
TOKENIZE_BATCH = 1024


@dataclass(frozen=True)
class LineError:
    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class ShardPlan:
    index: int
    first_line: int
    last_line: int
    start_byte: int
    end_byte: int
    request_count: int = 0
    prompt_tokens: int = 0  # an upper bound (see ``Scanner.count_tokens``)
    estimated_output_tokens: int = 0


@dataclass
class ScanResult:
    errors: list[LineError]
    model: str | None = None
    request_count: int = 0
    prompt_tokens: int = 0  # upper bound
    max_output_tokens: int = 0
    shards: list[ShardPlan] = field(default_factory=list)


@dataclass(frozen=True)
class Limits:
    endpoint: str
    served_model: str  # the id requests must name
    model_aliases: frozenset[str]  # other names that mean the served model
    max_lines: int
    shard_size: int


@dataclass
class _Request:
    line: int
    start: int
    end: int
    parsed: ParsedBody
    prompt_tokens: int = 0  # exact when it was counted, else an upper bound
    exact: bool = False


class _Valid(NamedTuple):
    line: int
    start: int
    end: int
    prompt_tokens: int  # exact, or an upper bound
    output_tokens: int  # upper bound


def iter_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, int, int, bytes]]:
    """``(line_number, start_byte, end_byte, content)`` for each line; the newline is in the
    byte range but not in the content."""
    pieces: list[bytes] = []
    line = 0
    offset = 0  # where the current line starts
    for chunk in chunks:
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                pieces.append(chunk[start:])
                break
            pieces.append(chunk[start:nl])
            content = b"".join(pieces) if len(pieces) > 1 else pieces[0]
            pieces = []
            line += 1
            end = offset + len(content) + 1
            yield line, offset, end, content
            offset = end
            start = nl + 1
    rest = b"".join(pieces)
    if rest:
        yield line + 1, offset, offset + len(rest), rest


class Scanner:
    def __init__(self, limits: Limits, counter: PromptCounter):
        self.limits = limits
        self.counter = counter
        self.errors: list[LineError] = []
        self.seen_ids: set[str] = set()
        self.first_model: tuple[str, int] | None = None
        self.pending: list[_Request] = []
        self.done: list[_Valid] = []  # compact: the bodies are dropped once checked
        # running upper bounds of the valid requests so far, for the estimate while validating
        self.prompt_tokens = 0
        self.output_tokens = 0

    def error(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            if len(message) > MAX_MESSAGE:  # messages quote the input, which may be huge
                message = message[: MAX_MESSAGE - 1] + "…"
            self.errors.append(LineError(code, message, line, (param or "")[:MAX_MESSAGE] or None))

    @property
    def full(self) -> bool:
        return len(self.errors) >= MAX_REPORTED_ERRORS

    def scan(self, chunks: Iterable[bytes], progress: Callable[[Scanner], bool] | None = None) -> ScanResult:
        """Check every line; ``progress(self)`` is called now and then and may return False to
        stop early (the batch was cancelled)."""
        lines = 0
        requests = 0
        for lines, start, end, content in iter_lines(chunks):
            if lines > self.limits.max_lines:
                self.error("too_many_lines", f"the file has more than {self.limits.max_lines} lines", lines)
                break
            request = self.check_line(lines, content)
            if request is not None:
                request.start, request.end = start, end
                self.pending.append(request)
                requests += 1
            if len(self.pending) >= TOKENIZE_BATCH:
                self.count_tokens()
            if self.full or (progress is not None and lines % 4096 == 0 and progress(self) is False):
                break
        self.count_tokens()
        if requests == 0 and not self.errors:
            self.error("empty_file", "the file holds no requests", None)
        return self.result()

    def check_line(self, line: int, content: bytes) -> _Request | None:
        if not content.strip():
            return None  # blank lines are not requests
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.error("invalid_encoding", f"the line is not valid UTF-8 (byte {exc.start})", line)
            return None
        try:
            obj = json.loads(text.lstrip("\ufeff") if line == 1 else text)
        except json.JSONDecodeError as exc:
            self.error("invalid_json_line", f"the line is not valid JSON: {exc.msg} (column {exc.colno})", line)
            return None
        if not isinstance(obj, dict):
            self.error("invalid_json_line", f"the line must be a JSON object, not {type(obj).__name__}", line)
            return None
        return self.check_request(line, obj)

    def check_request(self, line: int, obj: dict) -> _Request | None:
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            self.error("missing_custom_id", "'custom_id' is required and must be a non-empty string", line, "custom_id")
            return None
        if custom_id in self.seen_ids:
            self.error("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once", line, "custom_id")
            return None
        self.seen_ids.add(custom_id)
        if obj.get("method") != "POST":
            self.error("invalid_method", f"'method' must be 'POST', got {obj.get('method')!r}", line, "method")
            return None
        if obj.get("url") != self.limits.endpoint:
            self.error(
                "invalid_url", f"'url' must be the batch endpoint {self.limits.endpoint!r}, got {obj.get('url')!r}",
                line, "url",
            )
            return None
        try:
            parsed = parse_body(self.limits.endpoint, obj.get("body"))
        except BodyError as exc:
            param = "body" if exc.param in (None, "body") else f"body.{exc.param}"
            self.error(exc.code, exc.message, line, param)
            return None
        return self.check_model(line, parsed)

    def check_model(self, line: int, parsed: ParsedBody) -> _Request | None:
        model = self.limits.served_model if parsed.model in self.limits.model_aliases else parsed.model
        if self.first_model is None:
            self.first_model = (model, line)
        elif model != self.first_model[0]:
            first, first_line = self.first_model
            self.error(
                "mismatched_model",
                f"a batch uses one model; line {first_line} uses {first!r} and this line {parsed.model!r}",
                line, "body.model",
            )
            return None
        if model != self.limits.served_model:
            self.error(
                "model_not_found",
                f"the model {parsed.model!r} does not exist; this service runs {self.limits.served_model!r}",
                line, "body.model",
            )
            return None
        return _Request(line, 0, 0, parsed)

    def count_tokens(self) -> None:
        """Check the pending requests against the context, tokenizing only where needed.

        A prompt has at most as many tokens as UTF-8 bytes (plus what the tokenizer adds), so
        most prompts are proven to fit without tokenizing; the rest are counted exactly, in
        one batch. Exact counts of every prompt are recorded later (``prompt_counting``), off
        the path that holds the batch in ``validating``.
        """
        if not self.pending:
            return
        context = self.counter.context_length
        for request in self.pending:
            request.prompt_tokens, request.exact = prompt_bound(self.counter, request.parsed)
        unsure = [r for r in self.pending if not r.exact and not _fits(r, context)]
        for request, count in zip(unsure, exact_counts(self.counter, [r.parsed for r in unsure]), strict=True):
            request.prompt_tokens, request.exact = count, True
        for request in self.pending:
            if _fits(request, context):
                output = output_bound(request.parsed, request.prompt_tokens if request.exact else 1, context)
                self.done.append(_Valid(request.line, request.start, request.end, request.prompt_tokens, output))
                self.prompt_tokens += request.prompt_tokens
                self.output_tokens += output
                continue
            count, wanted = request.prompt_tokens, request.parsed.max_tokens
            if count >= context:
                message = f"the prompt is {count} tokens; the model's context is {context} tokens"
                param = "body.messages" if request.parsed.messages is not None else "body.prompt"
            else:
                message = (f"the prompt ({count} tokens) and max_tokens ({wanted}) exceed the model's "
                           f"context of {context} tokens")
                param = "body.max_tokens"
            self.error("context_length_exceeded", message, request.line, param)
        self.pending = []

    def result(self) -> ScanResult:
        if self.errors:
            return ScanResult(errors=self.errors)
        result = ScanResult(errors=[], model=self.limits.served_model, request_count=len(self.done))
        size = self.limits.shard_size
        for index, begin in enumerate(range(0, len(self.done), size)):
            chunk = self.done[begin : begin + size]
            shard = ShardPlan(index, chunk[0].line, chunk[-1].line, chunk[0].start, chunk[-1].end, len(chunk))
            for request in chunk:
                shard.prompt_tokens += request.prompt_tokens
                shard.estimated_output_tokens += request.output_tokens
            result.prompt_tokens += shard.prompt_tokens
            result.max_output_tokens += shard.estimated_output_tokens
            result.shards.append(shard)
        return result


def _fits(request: _Request, context: int) -> bool:
    wanted = request.parsed.max_tokens or 0
    return request.prompt_tokens < context and request.prompt_tokens + wanted <= context


def output_bound(parsed: ParsedBody, prompt_tokens: int, context: int) -> int:
    """The most tokens a request may generate: max_tokens, or the rest of the context."""
    return (parsed.max_tokens or max(context - prompt_tokens, 0)) * parsed.n


def prompt_text(counter: PromptCounter, parsed: ParsedBody) -> tuple[str, bool] | None:
    """The text a request's prompt is tokenized from and whether special tokens are added;
    None for a prompt given as token ids."""
    if parsed.messages is not None:
        return counter.render_chat(parsed.messages), False
    if isinstance(parsed.prompt, list):
        return None
    return parsed.prompt, True


def prompt_bound(counter: PromptCounter, parsed: ParsedBody) -> tuple[int, bool]:
    """``(tokens, exact)``: exact for token-id prompts, else an upper bound from the bytes."""
    text = prompt_text(counter, parsed)
    if text is None:
        return len(parsed.prompt), True
    return counter.upper_bound(*text), False


def exact_counts(counter: PromptCounter, requests: list[ParsedBody]) -> list[int]:
    """Exact prompt token counts, tokenized in batches."""
    texts = [prompt_text(counter, p) for p in requests]
    chat = [t for t, add in (x for x in texts if x is not None) if not add]
    plain = [t for t, add in (x for x in texts if x is not None) if add]
    chat_counts = iter(counter.count_texts(chat, add_special_tokens=False))
    plain_counts = iter(counter.count_texts(plain, add_special_tokens=True))
    out = []
    for parsed, text in zip(requests, texts, strict=True):
        if text is None:
            out.append(len(parsed.prompt))
        else:
            out.append(next(plain_counts if text[1] else chat_counts))
    return out

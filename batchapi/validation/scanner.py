"""Validation of a batch's input file: one streaming pass, every problem with its line number.

``scan`` reads the file in chunks, checks each line (JSON object, ``custom_id``, method, url,
model, body) with ``openai.lines.parse_line``, counts prompt tokens in batches and cuts the
requests into shards. It touches no database: ``runner`` claims the batch, calls it and
records the outcome.

Two kinds of problem, as OpenAI has them: a problem of the file (not JSON, no ``custom_id``,
the wrong url or model, too long a prompt, ...) is in ``errors`` and fails the batch; a problem
inside one request's body (``RequestError.in_body``: an unknown parameter, a bad value) is in
``request_errors`` and only that request fails: it stays in its shard, with no tokens counted,
and the worker writes it to the error file as a 400. Anthropic validates each request of a
Message Batch on its own, so there the model and the context are the request's concern too
(``Limits.each_request``): one request too long for the model errors alone, as the worker's
``Codec`` refuses it again when its shard runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from batchapi.grammar.check import GrammarError, check_grammar
from batchapi.openai.body import MESSAGES, SCHEMA_PARAM, ParsedBody
from batchapi.openai.embeddings import EMBEDDINGS
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import LongLine, is_blank, iter_lines, parse_line
from batchapi.openai.tools import grammar_spec
from batchapi.validation.token_counts import (
    PromptCounter,
    context_error,
    embedding_counts,
    exact_counts,
    model_error,
    output_bound,
    prompt_bound,
    prompt_floor,
)

MAX_REPORTED_ERRORS = 100
MAX_MESSAGE = 300
TOKENIZE_BATCH = 1024
TOKENIZE_BYTES = 1 << 20  # or this many bytes of lines, so the bodies held stay few when lines are long


@dataclass(frozen=True)
class LineError:
    """One entry of a failed batch's ``errors.data`` or of a batch's ``request_errors.data``."""

    code: ErrorCode
    message: str
    line: int | None = None
    param: str | None = None

    @classmethod
    def capped(cls, code: ErrorCode, message: str, line: int | None, param: str | None) -> LineError:
        if len(message) > MAX_MESSAGE:  # messages quote the input, which may be huge
            message = message[: MAX_MESSAGE - 1] + "…"
        return cls(code, message, line, (param or "")[:MAX_MESSAGE] or None)

    def as_dict(self) -> dict:
        return {"code": str(self.code), "message": self.message, "param": self.param, "line": self.line}


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
    errors: list[LineError]  # problems of the file: any fails the batch
    # problems of single request bodies (the first MAX_REPORTED_ERRORS, and how many in all):
    # those requests run as 400s
    request_errors: list[LineError] = field(default_factory=list)
    request_error_total: int = 0
    model: str | None = None
    request_count: int = 0
    prompt_tokens: int = 0  # upper bound
    max_output_tokens: int = 0
    shards: list[ShardPlan] = field(default_factory=list)

    @property
    def request_report(self) -> dict | None:
        """The batch's ``request_errors``: None when every body was good."""
        if not self.request_error_total:
            return None
        return {"object": "list", "data": [e.as_dict() for e in self.request_errors],
                "total": self.request_error_total}


@dataclass(frozen=True)
class Limits:
    endpoint: str
    served_model: str  # the id requests must name
    model_aliases: frozenset[str]  # other names that mean the served model
    max_lines: int
    shard_size: int
    max_line_bytes: int | None = None  # None: no limit (``Settings.max_line_bytes`` in the service)
    max_inputs: int | None = None  # embedding inputs across the file (``Settings.max_embedding_inputs``)

    @property
    def each_request(self) -> bool:
        """The model and the context are each request's concern, not the file's (Anthropic's rule)."""
        return self.endpoint == MESSAGES


@dataclass
class _Request:
    line: int
    start: int
    end: int
    parsed: ParsedBody | None  # None: the body was refused, the request becomes a 400 line
    prompt_tokens: int = 0  # exact when it was counted, else an upper bound (a lower one if ``floor``)
    exact: bool = False
    floor: bool = False


class _Valid(NamedTuple):
    line: int
    start: int
    end: int
    prompt_tokens: int  # exact, or an upper bound
    output_tokens: int  # upper bound


class Scanner:
    def __init__(self, limits: Limits, counter: PromptCounter):
        self.limits = limits
        self.counter = counter
        self.errors: list[LineError] = []
        self.request_errors: list[LineError] = []
        self.request_error_total = 0
        self.seen_ids: set[str] = set()
        self.first_model: tuple[str, int] | None = None
        self.pending: list[_Request] = []
        self.pending_bytes = 0
        self.done: list[_Valid] = []  # compact: the bodies are dropped once checked
        # running upper bounds of the valid requests so far, for the estimate while validating
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.inputs = 0  # embedding inputs so far

    def error(self, code: ErrorCode, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(LineError.capped(code, message, line, param))

    def request_error(self, line: int, error: RequestError) -> None:
        self.request_error_total += 1
        if len(self.request_errors) < MAX_REPORTED_ERRORS:
            self.request_errors.append(LineError.capped(error.code, error.message, line, error.line_param))

    @property
    def full(self) -> bool:
        return len(self.errors) >= MAX_REPORTED_ERRORS

    def scan(self, chunks: Iterable[bytes], progress: Callable[[Scanner], bool] | None = None) -> ScanResult:
        """Check every line; ``progress(self)`` is called now and then and may return False to
        stop early (the batch was cancelled)."""
        lines = 0
        requests = 0
        for lines, start, end, content in iter_lines(chunks, self.limits.max_line_bytes):
            if lines > self.limits.max_lines:
                self.error(ErrorCode.TOO_MANY_LINES, f"the file has more than {self.limits.max_lines} lines", lines)
                break
            request = self.check_line(lines, content)
            if request is not None:
                request.start, request.end = start, end
                self.pending.append(request)
                self.pending_bytes += end - start
                requests += 1
            if len(self.pending) >= TOKENIZE_BATCH or self.pending_bytes >= TOKENIZE_BYTES:
                self.count_tokens()
            if self.full or (progress is not None and lines % 4096 == 0 and progress(self) is False):
                break
        self.count_tokens()
        if requests == 0 and not self.errors:
            self.error(ErrorCode.EMPTY_FILE, "the file holds no requests", None)
        return self.result()

    def check_line(self, line: int, content: bytes | LongLine) -> _Request | None:
        if is_blank(content):
            return None  # blank lines are not requests
        parsed = parse_line(content, line, self.limits.endpoint)
        if parsed.custom_id is not None:
            if parsed.custom_id in self.seen_ids:
                self.error(ErrorCode.DUPLICATE_CUSTOM_ID, f"custom_id {parsed.custom_id!r} appears more than once",
                           line, "custom_id")
                return None
            self.seen_ids.add(parsed.custom_id)
        error = parsed.error or _grammar_problem(parsed.body)
        if error is not None and not error.in_body:
            self.error(error.code, error.message, line, error.line_param)
            return None
        each = self.limits.each_request
        if error is None or not each:  # OpenAI's: the model is the file's concern even in a refused body
            model = parsed.body.model if parsed.body is not None else parsed.model
            if model is not None and not self.check_model(line, model):
                return _Request(line, 0, 0, None) if each else None
        if error is not None:
            self.request_error(line, error)
            return _Request(line, 0, 0, None)
        if parsed.body.inputs is not None and not self.check_inputs(line, len(parsed.body.inputs)):
            return None
        return _Request(line, 0, 0, parsed.body)

    def check_inputs(self, line: int, count: int) -> bool:
        """The batch's embedding inputs stay within ``max_inputs`` (OpenAI's 50,000)."""
        before, self.inputs = self.inputs, self.inputs + count
        limit = self.limits.max_inputs
        if limit is None or self.inputs <= limit or before > limit:
            return True  # reported once, at the line that crosses it
        self.error(ErrorCode.TOO_MANY_INPUTS, f"the batch's requests hold more than {limit} embedding inputs in all; "
                   f"this line brings them to {self.inputs}", line, "body.input")
        return False

    def check_model(self, line: int, named: str) -> bool:
        model = self.limits.served_model if named in self.limits.model_aliases else named
        if self.limits.each_request:  # the batch runs the served model its first such request named
            error = model_error(named, self.limits.model_aliases | {self.limits.served_model}, self.limits.served_model)
            if error is not None:
                self.request_error(line, error)
            return error is None
        if self.first_model is None:
            self.first_model = (model, line)
        elif model != self.first_model[0]:
            first, first_line = self.first_model
            self.error(
                ErrorCode.MISMATCHED_MODEL,
                f"a batch uses one model; line {first_line} uses {first!r} and this line {named!r}",
                line, "body.model",
            )
            return False
        if model != self.limits.served_model:
            self.error(
                ErrorCode.MODEL_NOT_FOUND,
                f"the model {named!r} does not exist; this service runs {self.limits.served_model!r}",
                line, "body.model",
            )
            return False
        return True

    def count_tokens(self) -> None:
        """Check the pending requests against the context, tokenizing only where needed.

        A prompt has at most as many tokens as UTF-8 bytes (plus what the tokenizer adds), so
        most prompts are proven to fit without tokenizing; the rest are counted exactly, in
        one batch. Exact counts of every prompt are recorded later (``backfill``), off
        the path that holds the batch in ``validating``.
        """
        if not self.pending:
            return
        if self.limits.endpoint == EMBEDDINGS:
            self.count_embeddings()
            return
        context = self.counter.context_length
        bodies = [r for r in self.pending if r.parsed is not None]
        for request in bodies:
            request.prompt_tokens, request.exact = prompt_bound(self.counter, request.parsed)
        unsure = [r for r in bodies if not r.exact and not _fits(r, context)]
        for request in unsure:  # a prompt that surely cannot fit is refused untokenized
            floor = prompt_floor(self.counter, request.parsed)
            if floor >= context:
                request.prompt_tokens, request.floor = floor, True
        unsure = [r for r in unsure if not r.floor]
        for request, count in zip(unsure, exact_counts(self.counter, [r.parsed for r in unsure]), strict=True):
            request.prompt_tokens, request.exact = count, True
        for request in self.pending:
            if request.parsed is None:  # refused when its shard runs: no prompt, no output
                self.done.append(_Valid(request.line, request.start, request.end, 0, 0))
                continue
            if _fits(request, context):
                output = output_bound(request.parsed, request.prompt_tokens if request.exact else 1, context)
                self.done.append(_Valid(request.line, request.start, request.end, request.prompt_tokens, output))
                self.prompt_tokens += request.prompt_tokens
                self.output_tokens += output
                continue
            error = context_error(request.parsed, request.prompt_tokens, context, at_least=request.floor)
            if self.limits.each_request:  # that request's 400, in its shard, no tokens counted
                self.request_error(request.line, error)
                self.done.append(_Valid(request.line, request.start, request.end, 0, 0))
                continue
            self.error(error.code, error.message, request.line, error.line_param)
        self.pending, self.pending_bytes = [], 0

    def count_embeddings(self) -> None:
        """Embedding inputs never exceed the context: the worker cuts them to the model's window.
        Their exact counts are cheap (short inputs, one batched tokenizer call)."""
        bodies = [r for r in self.pending if r.parsed is not None]
        for request, count in zip(bodies, embedding_counts(self.counter, [r.parsed for r in bodies]), strict=True):
            request.prompt_tokens, request.exact = count, True
        for request in self.pending:
            self.done.append(_Valid(request.line, request.start, request.end, request.prompt_tokens, 0))
            self.prompt_tokens += request.prompt_tokens
        self.pending, self.pending_bytes = [], 0

    def result(self) -> ScanResult:
        # in line order: a context problem is found a tokenizing batch after the body problems around it
        reported = sorted(self.request_errors, key=lambda e: e.line or 0)
        requests = dict(request_errors=reported, request_error_total=self.request_error_total)
        if self.errors:
            return ScanResult(errors=self.errors, **requests)
        result = ScanResult(errors=[], model=self.limits.served_model, request_count=len(self.done), **requests)
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


def _grammar_problem(body: ParsedBody | None) -> RequestError | None:
    """The grammar engine's refusal of the schema a request's output must follow: the worker's
    compile would refuse it too, so it is reported now (each distinct schema is checked once)."""
    spec = grammar_spec(body) if body is not None else None
    if spec is None:
        return None
    try:
        check_grammar(spec)
    except GrammarError as exc:
        param = "tools" if body.tool_choice == "required" else SCHEMA_PARAM[body.endpoint]
        return RequestError(str(exc), param, ErrorCode.INVALID_JSON_SCHEMA)
    return None


def _fits(request: _Request, context: int) -> bool:
    return context_error(request.parsed, request.prompt_tokens, context) is None

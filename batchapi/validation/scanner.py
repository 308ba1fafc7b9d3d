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
``Codec`` refuses it again when its shard runs. There each request also runs on the served model
it names (``Limits.more_models``): its prompt is counted with that model's tokenizer, and the
shards are cut per model (``ShardPlan.lines`` names a shard's lines where its model's requests
are not the only ones in its byte range). A request refused before its model is known runs in a
shard of the batch's first model, whose worker refuses it again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from batchapi.grammar.check import GrammarError, check_grammar
from batchapi.openai.body import MESSAGES, SCHEMA_PARAM, ParsedBody
from batchapi.openai.embeddings import EMBEDDINGS
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import LongLine, is_blank, iter_lines, parse_line
from batchapi.openai.reasoning import reasoning_error
from batchapi.openai.tools import grammar_spec
from batchapi.validation.token_counts import (
    PromptCounter,
    context_error,
    embedding_counts,
    exact_counts,
    model_error,
    more_prompt_counts,
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
    model: str | None = None  # the served model that runs it
    lines: list[int] | None = None  # its requests' lines, when not every request of the range is its own


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

    def estimates(self) -> dict[str, tuple[int, int]]:
        """Per model, the prompt tokens and the max_tokens bound of its shards."""
        out: dict[str, tuple[int, int]] = {}
        for shard in self.shards:
            prompt, output = out.get(shard.model, (0, 0))
            out[shard.model] = (prompt + shard.prompt_tokens, output + shard.estimated_output_tokens)
        return out

    def enqueued(self) -> dict[str, int]:
        """Per model, the tokens a quota counts for this batch as it starts (``estimates``)."""
        return {model or self.model or "": sum(pair) for model, pair in self.estimates().items()}

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
    thinking_key: bytes = b""  # verifies thinking blocks sent back (``Settings.thinking_key``)
    # ``each_request``: the other served models its requests may name (id -> every name of it)
    more_models: dict[str, frozenset[str]] = field(default_factory=dict)

    @property
    def each_request(self) -> bool:
        """The model and the context are each request's concern, not the file's (Anthropic's rule)."""
        return self.endpoint == MESSAGES

    def served_for(self, named: str) -> str | None:
        """The served model (of the batch's) that ``named`` means, or None."""
        if named in self.model_aliases or named == self.served_model:
            return self.served_model
        return next((model for model, names in self.more_models.items() if named in names), None)

    def every_name(self) -> frozenset[str]:
        return frozenset({self.served_model, *self.model_aliases}.union(*self.more_models.values()))


@dataclass
class _Request:
    line: int
    start: int
    end: int
    parsed: ParsedBody | None  # None: the body was refused, the request becomes a 400 line
    prompt_tokens: int = 0  # exact when it was counted, else an upper bound (a lower one if ``floor``)
    exact: bool = False
    floor: bool = False
    model: str | None = None  # the served model that runs it; None: the batch's first


class _Valid(NamedTuple):
    line: int
    start: int
    end: int
    prompt_tokens: int  # exact, or an upper bound
    output_tokens: int  # upper bound
    model: str


class Scanner:
    def __init__(self, limits: Limits, counter: PromptCounter, more_counters: dict[str, PromptCounter] | None = None):
        """``more_counters``: the counters of ``limits.more_models``, by model id."""
        self.limits = limits
        self.counter = counter
        self.counters = {limits.served_model: counter, **(more_counters or {})}
        assert set(limits.more_models) <= set(self.counters), "a counter for each model its requests may name"
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
        error = parsed.error or _grammar_problem(parsed.body, self) or _reasoning_problem(parsed.body, self)
        if error is not None and not error.in_body:
            self.error(error.code, error.message, line, error.line_param)
            return None
        each = self.limits.each_request
        served = None
        if error is None or not each:  # OpenAI's: the model is the file's concern even in a refused body
            model = parsed.body.model if parsed.body is not None else parsed.model
            if model is not None and each:
                served = self.request_model(line, model)
                if served is None:
                    return _Request(line, 0, 0, None)
            elif model is not None and not self.check_model(line, model):
                return None
        if error is not None:
            self.request_error(line, error)
            return _Request(line, 0, 0, None)
        if parsed.body.inputs is not None and not self.check_inputs(line, len(parsed.body.inputs)):
            return None
        return _Request(line, 0, 0, parsed.body, model=served)

    def check_inputs(self, line: int, count: int) -> bool:
        """The batch's embedding inputs stay within ``max_inputs`` (OpenAI's 50,000)."""
        before, self.inputs = self.inputs, self.inputs + count
        limit = self.limits.max_inputs
        if limit is None or self.inputs <= limit or before > limit:
            return True  # reported once, at the line that crosses it
        self.error(ErrorCode.TOO_MANY_INPUTS, f"the batch's requests hold more than {limit} embedding inputs in all; "
                   f"this line brings them to {self.inputs}", line, "body.input")
        return False

    def request_model(self, line: int, named: str) -> str | None:
        """The served model a Message Batch request runs on; None (and that request's error) when
        the batch runs no model of that name."""
        served = self.limits.served_for(named)
        if served is None:
            self.request_error(line, model_error(named, self.limits.every_name(),
                                                 [self.limits.served_model, *self.limits.more_models]))
        return served

    def check_model(self, line: int, named: str) -> bool:
        model = self.limits.served_model if named in self.limits.model_aliases else named
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
        by_model: dict[str, list[_Request]] = defaultdict(list)
        for request in self.pending:
            request.model = request.model or self.limits.served_model
            by_model[request.model].append(request)
        for model, pending in by_model.items():
            self.count_model(pending, self.counters[model])
        self.pending, self.pending_bytes = [], 0

    def count_model(self, pending: list[_Request], counter: PromptCounter) -> None:
        """``count_tokens`` for the pending requests of one model, with its tokenizer and context."""
        context = counter.context_length
        bodies = [r for r in pending if r.parsed is not None]
        for request in bodies:
            request.prompt_tokens, request.exact = prompt_bound(counter, request.parsed)
        unsure = [r for r in bodies if not r.exact and not _fits(r, context)]
        for request in unsure:  # a prompt that surely cannot fit is refused untokenized
            floor = prompt_floor(counter, request.parsed)
            if floor >= context:
                request.prompt_tokens, request.floor = floor, True
        unsure = [r for r in unsure if not r.floor]
        for request, count in zip(unsure, exact_counts(counter, [r.parsed for r in unsure]), strict=True):
            request.prompt_tokens, request.exact = count, True
        for request in pending:
            if request.parsed is None:  # refused when its shard runs: no prompt, no output
                self.done.append(_Valid(request.line, request.start, request.end, 0, 0, request.model))
                continue
            error = _more_prompts_error(counter, request, context) if request.parsed.more_prompts else None
            if error is None and _fits(request, context):
                output = output_bound(request.parsed, request.prompt_tokens if request.exact else 1, context)
                self.done.append(_Valid(request.line, request.start, request.end, request.prompt_tokens, output,
                                         request.model))
                self.prompt_tokens += request.prompt_tokens
                self.output_tokens += output
                continue
            error = error or context_error(request.parsed, request.prompt_tokens, context, at_least=request.floor)
            if self.limits.each_request:  # that request's 400, in its shard, no tokens counted
                self.request_error(request.line, error)
                self.done.append(_Valid(request.line, request.start, request.end, 0, 0, request.model))
                continue
            self.error(error.code, error.message, request.line, error.line_param)

    def count_embeddings(self) -> None:
        """Embedding inputs never exceed the context: the worker cuts them to the model's window.
        Their exact counts are cheap (short inputs, one batched tokenizer call)."""
        bodies = [r for r in self.pending if r.parsed is not None]
        for request, count in zip(bodies, embedding_counts(self.counter, [r.parsed for r in bodies]), strict=True):
            request.prompt_tokens, request.exact = count, True
        for request in self.pending:
            self.done.append(_Valid(request.line, request.start, request.end, request.prompt_tokens, 0,
                                    self.limits.served_model))
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
        by_model: dict[str, list[_Valid]] = defaultdict(list)
        for request in sorted(self.done, key=lambda r: r.line):  # counted a model at a time
            by_model[request.model].append(request)
        several = len(by_model) > 1
        chunks = [(model, requests[begin : begin + size]) for model, requests in by_model.items()
                  for begin in range(0, len(requests), size)]
        for index, (model, chunk) in enumerate(chunks):
            shard = ShardPlan(index, chunk[0].line, chunk[-1].line, chunk[0].start, chunk[-1].end, len(chunk),
                              model=model, lines=[r.line for r in chunk] if several else None)
            for request in chunk:
                shard.prompt_tokens += request.prompt_tokens
                shard.estimated_output_tokens += request.output_tokens
            result.prompt_tokens += shard.prompt_tokens
            result.max_output_tokens += shard.estimated_output_tokens
            result.shards.append(shard)
        return result


def _grammar_problem(body: ParsedBody | None, scanner: Scanner) -> RequestError | None:
    """The grammar engine's refusal of the schema a request's output must follow: the worker's
    compile would refuse it too, so it is reported now (each distinct schema is checked once);
    and a schema whose shortest document is longer than the model's context can hold (its tokens
    times the most bytes one token stands for, where the tokenizer bounds that)."""
    spec = grammar_spec(body) if body is not None else None
    if spec is None:
        return None
    served = scanner.limits.served_for(body.model) if scanner.limits.each_request else None
    counter = scanner.counters.get(served, scanner.counter)  # the model the request runs on
    context_bytes = None if counter.max_token_bytes is None else counter.context_length * counter.max_token_bytes
    try:
        check_grammar(spec, context_bytes)
    except GrammarError as exc:
        param = "tools" if body.tool_choice == "required" else SCHEMA_PARAM[body.endpoint]
        return RequestError(str(exc), param, ErrorCode.INVALID_JSON_SCHEMA)
    return None


def _more_prompts_error(counter: PromptCounter, request: _Request, context: int) -> RequestError | None:
    """A completions body of several prompts: each must fit the context as the first does, and all
    count. Adds their tokens to the request's; the refusal of the first that cannot fit."""
    counts = more_prompt_counts(counter, request.parsed)
    for count in counts:
        if (error := context_error(request.parsed, count, context)) is not None:
            return error
    request.prompt_tokens += sum(counts)
    return None


def _fits(request: _Request, context: int) -> bool:
    return context_error(request.parsed, request.prompt_tokens, context) is None


def _reasoning_problem(parsed: ParsedBody | None, scanner: Scanner) -> RequestError | None:
    """Thinking asked of a model whose template cannot think, or a thinking block sent back
    whose signature does not verify: that request's 400 (``openai.reasoning``)."""
    if parsed is None or parsed.messages is None:
        return None
    served = scanner.limits.served_for(parsed.model) if scanner.limits.each_request else None
    counter = scanner.counters.get(served, scanner.counter)  # the template of the model the request runs on
    return reasoning_error(parsed, counter.thinking, scanner.limits.thinking_key)

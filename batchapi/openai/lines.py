"""The one parser of batch input lines: validation, the shard reader and ``run-batch`` use it.

A line is ``{"custom_id", "method": "POST", "url", "body"}`` (docs/API.md). ``iter_lines`` cuts a
stream of bytes into lines with their byte ranges; ``parse_line`` checks one of them and
returns what it holds, or why it cannot run, with an ``ErrorCode``; ``peek_line`` reads only the
fields that route a line (its ``custom_id``, ``url`` and body's ``model``) without checking it, for
the callers that must know them before, or whatever, the line's check says. The one BOM rule
(``strip_bom``) is here too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from batchapi.openai.body import ENDPOINTS, ParsedBody, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.text import lone_surrogate, storable

BOM = "\ufeff"


@dataclass
class InputLine:
    """One request line as far as it parsed: ``body`` when it is good, else ``error``."""

    line: int  # 1-based line number in the input file
    custom_id: str | None  # None when the line holds no usable one
    body: ParsedBody | None
    error: RequestError | None = None
    # the line's ``url`` and body's ``model`` as written, when the line is a JSON object, even one
    # whose body was refused (OpenAI's model check and run-batch's routing read them there)
    url: str | None = None
    model: str | None = None


@dataclass(frozen=True)
class LineFields:
    """What ``peek_line`` reads of a line: each field as written when it is a non-empty string."""

    custom_id: str | None
    url: str | None
    model: str | None


@dataclass(frozen=True)
class LongLine:
    """What ``iter_lines`` gives in place of a line longer than its limit: the line's bytes
    were skipped, never held, so one huge line costs no memory."""

    size: int  # bytes of content, the newline not counted
    limit: int


def iter_lines(chunks: Iterable[bytes], max_line_bytes: int | None = None) -> Iterator[tuple[int, int, int, bytes | LongLine]]:
    """``(line_number, start_byte, end_byte, content)`` for each line; the newline is in the
    byte range but not in the content. A line of more than ``max_line_bytes`` bytes comes as a
    ``LongLine`` (``parse_line`` turns it into ``line_too_long``)."""
    pieces: list[bytes] = []
    held = 0  # bytes in ``pieces``
    skipped = 0  # bytes of the current line dropped once it passed the limit
    line = 0
    offset = 0  # where the current line starts
    for chunk in chunks:
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            size = (len(chunk) if nl < 0 else nl) - start
            if skipped or (max_line_bytes is not None and held + size > max_line_bytes):
                skipped += held + size  # counted, not kept
                pieces, held = [], 0
            else:
                pieces.append(chunk[start:] if nl < 0 else chunk[start:nl])
                held += size
            if nl < 0:
                break
            line += 1
            content = _content(pieces, skipped, max_line_bytes)
            end = offset + held + skipped + 1
            yield line, offset, end, content
            pieces, held, skipped, offset = [], 0, 0, end
            start = nl + 1
    if held or skipped:
        yield line + 1, offset, offset + held + skipped, _content(pieces, skipped, max_line_bytes)


def _content(pieces: list[bytes], skipped: int, limit: int | None) -> bytes | LongLine:
    if skipped:
        return LongLine(skipped, limit)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def is_blank(content: bytes | LongLine) -> bool:
    """A blank line is no request (an over-long line never is blank)."""
    return isinstance(content, bytes) and not content.strip()


def strip_bom(content: bytes, line: int) -> bytes:
    """A UTF-8 byte order mark is allowed before the first line, and is no part of it."""
    return content.removeprefix(_BOM_BYTES) if line == 1 else content


_BOM_BYTES = BOM.encode()


def parse_line(content: bytes | LongLine, line: int, endpoint: str | None) -> InputLine:
    """Check one non-blank line. ``endpoint`` is the batch's (the line's ``url`` must equal
    it), or None to take any supported endpoint (``run-batch``). A UTF-8 byte order mark is
    allowed before the first line."""
    record = None
    try:
        record = _record(content, line)
        custom_id = _custom_id_of(record)
        _check_route(record, endpoint)
        url = endpoint or record["url"]
        try:
            body = parse_body(url, record.get("body"))
        except RequestError as exc:
            exc.custom_id = custom_id
            raise
    except RequestError as exc:
        fields = _fields(record) if record is not None else LineFields(None, None, None)
        return InputLine(line, exc.custom_id, None, exc, fields.url, fields.model)
    fields = _fields(record)
    return InputLine(line, custom_id, body, None, fields.url, fields.model)


def peek_line(content: bytes | LongLine, line: int) -> LineFields | None:
    """The routing fields of a line, unchecked; None when it is not a JSON object (``parse_line``
    says what is wrong with it)."""
    if isinstance(content, LongLine):
        return None
    try:
        record = json.loads(strip_bom(content, line).decode("utf-8"))  # text: a BOM past line 1 is refused
    except (ValueError, RecursionError):  # not UTF-8 (a ValueError too), not JSON, nested too deep
        return None
    return _fields(record) if isinstance(record, dict) else None


def _fields(record: dict) -> LineFields:
    body = record.get("body")
    return LineFields(_text(record.get("custom_id")), _text(record.get("url")),
                      _text(body.get("model")) if isinstance(body, dict) else None)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _record(content: bytes | LongLine, line: int) -> dict:
    """The line's JSON object, with its lone surrogates refused once its ``custom_id`` is known."""
    if isinstance(content, LongLine):
        raise _line_error(f"the line is {content.size} bytes; the limit is {content.limit} bytes per line", None,
                          ErrorCode.LINE_TOO_LONG)
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _line_error(f"the line is not valid UTF-8 (byte {exc.start})", None,
                          ErrorCode.INVALID_ENCODING) from None
    try:
        record = json.loads(text.removeprefix(BOM) if line == 1 else text)
    except json.JSONDecodeError as exc:
        raise _line_error(f"the line is not valid JSON: {exc.msg} (column {exc.colno})", None,
                          ErrorCode.INVALID_JSON_LINE) from None
    except RecursionError:
        raise _line_error("the line's JSON is nested too deeply to read", None,
                          ErrorCode.INVALID_JSON_LINE) from None
    if not isinstance(record, dict):
        raise _line_error(f"the line must be a JSON object, not {type(record).__name__}", None,
                          ErrorCode.INVALID_JSON_LINE)
    if _SURROGATE_ESCAPE.search(text):  # only an escape can put one in: the bytes were UTF-8
        _check_text(record, _custom_id_of(record))
    return record


def _custom_id_of(record: dict) -> str:
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _line_error("'custom_id' is required and must be a non-empty string", "custom_id",
                          ErrorCode.MISSING_CUSTOM_ID)
    return custom_id


# a \uD800-\uDFFF escape; most are halves of a pair, which json.loads joins into one character
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_text(record: dict, custom_id: str) -> None:
    """Refuse a lone UTF-16 surrogate in any string (key or value) of the line: it is not
    Unicode text, so it can be neither stored nor written back as UTF-8."""
    stack: list[tuple[str, object]] = [("", record)]
    while stack:  # not recursive: the line may be nested as deep as json.loads allows
        path, value = stack.pop()
        if isinstance(value, str):
            if not storable(value):
                usable = None if path == "custom_id" else custom_id
                raise _line_error(lone_surrogate(f"'{path}'"), path, ErrorCode.INVALID_ENCODING, usable)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not storable(key):
                    raise _line_error(lone_surrogate(f"a key in {path or 'the line'}"), path or None,
                                      ErrorCode.INVALID_ENCODING, custom_id)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _check_route(record: dict, endpoint: str | None) -> None:
    custom_id = record["custom_id"]
    if record.get("method") != "POST":
        raise _line_error(f"'method' must be 'POST', got {record.get('method')!r}", "method",
                          ErrorCode.INVALID_METHOD, custom_id)
    url = record.get("url")
    if endpoint is not None and url != endpoint:
        raise _line_error(f"'url' must be the batch endpoint {endpoint!r}, got {url!r}", "url",
                          ErrorCode.INVALID_URL, custom_id)
    if endpoint is None and url not in ENDPOINTS:
        raise _line_error(f"'url' {url!r} is not supported; expected one of {list(ENDPOINTS)}", "url",
                          ErrorCode.INVALID_URL, custom_id)


def _line_error(message: str, param: str | None, code: ErrorCode, custom_id: str | None = None) -> RequestError:
    return RequestError(message, param, code, in_body=False, custom_id=custom_id)

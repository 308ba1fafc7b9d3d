"""The one parser of batch input lines: validation, the shard reader and ``run-batch`` use it.

A line is ``{"custom_id", "method": "POST", "url", "body"}`` (docs/API.md). ``iter_lines`` cuts a
stream of bytes into lines with their byte ranges; ``parse_line`` checks one of them and
returns what it holds, or why it cannot run, with an ``ErrorCode``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from batchapi.openai.body import ENDPOINTS, ParsedBody, parse_body
from batchapi.openai.errors import ErrorCode, RequestError

BOM = "\ufeff"


@dataclass
class InputLine:
    """One request line as far as it parsed: ``body`` when it is good, else ``error``."""

    line: int  # 1-based line number in the input file
    custom_id: str | None  # None when the line holds no usable one
    body: ParsedBody | None
    error: RequestError | None = None


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


def parse_line(content: bytes, line: int, endpoint: str | None) -> InputLine:
    """Check one non-blank line. ``endpoint`` is the batch's (the line's ``url`` must equal
    it), or None to take any supported endpoint (``run-batch``). A UTF-8 byte order mark is
    allowed before the first line."""
    try:
        record, custom_id = _record(content, line)
        _check_route(record, endpoint)
        url = endpoint or record["url"]
        try:
            body = parse_body(url, record.get("body"))
        except RequestError as exc:
            exc.custom_id = custom_id
            raise
    except RequestError as exc:
        return InputLine(line, exc.custom_id, None, exc)
    return InputLine(line, custom_id, body)


def _record(content: bytes, line: int) -> tuple[dict, str]:
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
    if not isinstance(record, dict):
        raise _line_error(f"the line must be a JSON object, not {type(record).__name__}", None,
                          ErrorCode.INVALID_JSON_LINE)
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _line_error("'custom_id' is required and must be a non-empty string", "custom_id",
                          ErrorCode.MISSING_CUSTOM_ID)
    return record, custom_id


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

"""A Message Batch's create body, ``{"requests": [{"custom_id", "params"}, ...]}``, read as a
stream into its input file (one line per request, ``{"custom_id", "method": "POST", "url":
"/v1/messages", "body": params}``).

The body is never held whole: ijson's events are read one at a time, each request's line is
written as soon as the request ends, and its size is counted while it is read, so a request past
``max_line_bytes`` is dropped as it grows (only its count goes on, for the error). Memory holds one
token and at most one line, whatever the body. The refusals are those of reading the whole body
first: a body that is not JSON, then the envelope (``requests``, its length, other fields), then
the first bad request in order (then the caller's: the input file's size); a name given twice
counts its last value, as ``json.loads`` does. A line is the request as ``json.dumps(..., ensure_ascii=False,
separators=(",", ":"))`` writes it, except that a name repeated inside ``params`` is written each
time (the line parser keeps the last, as here) and counts each time against the limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import ijson

from batchapi.errors import InvalidRequest
from batchapi.openai.body import MESSAGES

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHUNK = 64 * 1024
PIECES = 1024  # small strings a params object keeps before joining them into one
# json.loads reads about 990 levels (the interpreter's recursion limit), and the line is read back
# with it: a body nested deeper than this is not JSON, as json.loads found before
MAX_DEPTH = 960
OPEN, CLOSE = ("start_map", "start_array"), ("end_map", "end_array")
# two inputs on which yajl, under ijson's C backend, goes wrong: a lone UTF-16 surrogate escape
# (read as "?"), and an integer of more digits than int() takes (ijson 3.6 crashes on one at the
# end of the body): a body with either (or with something like one) is read by ijson's Python backend
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")  # most are halves of one
LONG_NUMBER = b"0" * 4300  # sys.get_int_max_str_digits()'s default, in a body whose digits are all 0
ZEROS = bytes.maketrans(b"123456789", b"000000000")
SURROGATE_SPAN = 12  # bytes of a pair
BOM = b"\xef\xbb\xbf"  # json.loads drops it from bytes too
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def not_json() -> InvalidRequest:
    return InvalidRequest("The request body is not valid JSON.")


def line_head(custom_id: str) -> bytes:
    """A request's line up to its ``params``; the line is this, the params, and ``}\\n``."""
    return (b'{"custom_id":' + _encode(custom_id).encode() + b',"method":"POST","url":' + _encode(MESSAGES).encode()
            + b',"body":')


@dataclass
class Params:
    """One request's ``params`` as read: its text as the line writes it (None once past the
    limit), its size in bytes, whether it holds a lone surrogate, its top-level ``model``."""

    text: bytes | None = None
    size: int = 0
    surrogate: bool = False
    model: str | None = None
    is_object: bool = True


@dataclass
class Request:
    """One request as read: what its line needs, or what is wrong with it."""

    keys_ok: bool = True  # an object of no name but custom_id and params
    has_id: bool = False
    custom_id: object = None
    params: Params | None = None


@dataclass
class Written:
    """What ``read_requests`` wrote: the number of requests, their models in order of first use,
    and the bytes of their lines (all of them, past ``max_file_bytes`` too)."""

    count: int = 0
    models: list[str] = field(default_factory=list)
    file_bytes: int = 0


class Reader:
    """One create body's events into lines; ``read`` raises the first refusal. The depth passed
    around is the number of containers open around a value."""

    def __init__(self, out: BinaryIO, max_line_bytes: int, max_requests: int, max_file_bytes: int):
        self.out, self.max_line_bytes = out, max_line_bytes
        self.max_requests, self.max_file_bytes = max_requests, max_file_bytes
        self.keep = max_line_bytes - len(line_head("")) - 2  # params past this make any line too long
        self.is_object = False
        self.requests_is_array = False
        self.unknown: str | None = None  # the first other field, in sorted order
        self._reset()

    def _reset(self) -> None:
        """A ``requests`` field: it replaces any before it."""
        self.out.seek(0)
        self.out.truncate()
        self.written = Written()
        self.seen: set[str] = set()
        self.models: dict[str, None] = {}
        self.refusal: InvalidRequest | None = None

    def read(self, events: Iterator[tuple[str, object]]) -> Written:
        try:
            event, _ = next(events)
            self.is_object = event == "start_map"
            if self.is_object:
                for event, key in events:
                    if event == "end_map":
                        break
                    self._field(key, events)
            else:
                _skip(event, events, 0)
            for _ in events:  # the end: what follows the value is checked by the parser
                pass
        except (ijson.JSONError, ValueError):  # ValueError: not UTF-8, an integer of over 4300 digits
            raise not_json() from None
        self._refuse()
        self.written.models = list(self.models)
        return self.written

    def _field(self, key: str, events) -> None:
        event, _ = next(events)
        if key != "requests":
            self.unknown = key if self.unknown is None else min(self.unknown, key)
            _skip(event, events, 1)
            return
        self._reset()
        self.requests_is_array = event == "start_array"
        if not self.requests_is_array:
            _skip(event, events, 1)
            return
        for event, _ in events:
            if event == "end_array":
                return
            i = self.written.count
            self.written.count += 1
            if self.refusal is not None or i >= self.max_requests:
                _skip(event, events, 2)  # refused already: only the count goes on
            else:
                self._request(i, event, events)

    def _refuse(self) -> None:
        count = self.written.count
        if not self.is_object or not self.requests_is_array or not count:
            raise InvalidRequest("requests: a non-empty array of {custom_id, params} is required", "requests")
        if count > self.max_requests:
            raise InvalidRequest(f"requests: at most {self.max_requests} requests per batch, got {count}", "requests")
        if self.unknown is not None:
            raise InvalidRequest(f"{self.unknown}: Extra inputs are not permitted", self.unknown)
        if self.refusal is not None:
            raise self.refusal

    def _request(self, i: int, event: str, events) -> None:
        request = Request(keys_ok=event == "start_map")
        if request.keys_ok:
            for event, key in events:
                if event == "end_map":
                    break
                self._request_field(request, key, events)
        else:
            _skip(event, events, 2)
        self.refusal = self._check(request, i)
        if self.refusal is None:
            self._write(request)

    def _request_field(self, request: Request, key: str, events) -> None:
        event, value = next(events)
        if key == "custom_id":
            request.has_id, request.custom_id = True, value if event == "string" else None
        elif key == "params" and event == "start_map":  # a second one replaces the first, as in json.loads
            request.params = read_params(events, self.keep, 3)
            return
        elif key == "params":
            request.params = Params(is_object=False)
        else:
            request.keys_ok = False
        _skip(event, events, 3)

    def _check(self, request: Request, i: int) -> InvalidRequest | None:
        at = f"requests.{i}"
        params = request.params
        if not request.keys_ok or not request.has_id or params is None:
            return InvalidRequest(f"{at}: each request must be an object of exactly 'custom_id' and 'params'", at)
        custom_id = request.custom_id
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            return InvalidRequest(f"{at}.custom_id: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'", f"{at}.custom_id")
        if custom_id in self.seen:
            return InvalidRequest(f"{at}.custom_id: the custom_id {custom_id!r} is used more than once; each "
                                  "request needs its own", f"{at}.custom_id")
        self.seen.add(custom_id)
        if not params.is_object:
            return InvalidRequest(f"{at}.params: must be an object", f"{at}.params")
        if params.surrogate:
            return InvalidRequest(f"{at}.params: holds a lone UTF-16 surrogate, which is not text", f"{at}.params")
        size = len(line_head(custom_id)) + params.size + 2
        if size > self.max_line_bytes:
            return InvalidRequest(f"{at}: the request is {size} bytes; the limit is {self.max_line_bytes}", at)
        return None

    def _write(self, request: Request) -> None:
        line = b"".join([line_head(request.custom_id), request.params.text, b"}\n"])
        self.written.file_bytes += len(line)
        if self.written.file_bytes <= self.max_file_bytes:  # past it: only counted, for the caller to refuse
            self.out.write(line)
        if request.params.model is not None:
            self.models.setdefault(request.params.model)


def read_params(events, keep: int, depth: int) -> Params:
    """A ``params`` object whose start was just read, ``depth`` containers deep, as the line writes
    it: kept while it is at most ``keep`` characters (so at most ``keep`` bytes of ASCII, 4x that of
    any text), then only counted. The hot loop of a create: one pass per event, a comma after every
    value, taken back when its container closes; the small pieces joined every ``PIECES``."""
    kept: list[str] = []  # joined pieces
    parts = ["{"]
    chars, size, level = 1, 0, 1
    counting = surrogate = model_next = False  # counting: too large, only counted
    model = None
    last = "{"
    for event, value in events:
        if model_next:
            model, model_next = value if event == "string" else None, False
        if event == "map_key":
            piece = _encode(value) + ":"
            model_next = level == 1 and value == "model"
        elif event == "string":
            piece = _encode(value) + ","
        elif event == "end_map" or event == "end_array":
            level -= 1
            if last[-1] == ",":  # the container's last value
                if parts:
                    parts[-1] = last[:-1]
                elif kept:
                    kept[-1] = kept[-1][:-1]
                chars, size = chars - 1, size - counting
            piece = ("}" if event == "end_map" else "]") + ("," if level else "")
        elif event == "start_map" or event == "start_array":
            level += 1
            if level + depth > MAX_DEPTH:
                raise not_json()
            piece = "{" if event == "start_map" else "["
        elif event == "number":
            piece = (str(value) if type(value) is int else _encode(float(value))) + ","  # as json.loads reads it
        else:
            piece = "null," if value is None else "true," if value else "false,"
        last = piece
        if not counting:
            chars += len(piece)
            parts.append(piece)
            if chars > keep:  # too large whatever its bytes: counted from here on, not kept
                size, surrogate = _utf8_size("".join([*kept, *parts]))
                kept, parts, counting = [], [], True
            elif len(parts) >= PIECES:
                kept.append("".join(parts))
                parts = []
        elif piece.isascii():
            size += len(piece)
        else:
            piece_size, piece_surrogate = _utf8_size(piece)
            size, surrogate = size + piece_size, surrogate or piece_surrogate
        if not level:
            break
    if counting:
        return Params(None, size, surrogate, model)
    text = "".join([*kept, *parts])
    try:
        data = text.encode()
    except UnicodeEncodeError:  # a lone surrogate (an escape, \\ud800): not text
        return Params(None, 0, True, model)
    return Params(data, len(data), False, model)


def _utf8_size(text: str) -> tuple[int, bool]:
    """Bytes of ``text`` as UTF-8, and whether it holds a lone surrogate."""
    try:
        return len(text.encode()), False
    except UnicodeEncodeError:
        return len(text.encode(errors="surrogatepass")), True


def _skip(event: str, events, depth: int) -> None:
    """Read past the value that ``event`` starts, ``depth`` containers deep."""
    if event not in OPEN:
        return
    level = 1
    for event, _ in events:
        if event in OPEN:
            level += 1
            if level + depth > MAX_DEPTH:
                raise not_json()
        elif event in CLOSE:
            level -= 1
            if level == 0:
                return


def events(source: BinaryIO) -> Iterator[tuple[str, object]]:
    """ijson's events of a seekable ``source``, from the backend that reads it right."""
    backend = ijson.get_backend("python") if _needs_python(source) else ijson
    if source.read(len(BOM)) != BOM:
        source.seek(0)
    return backend.basic_parse(source, buf_size=CHUNK)


def _needs_python(source: BinaryIO) -> bool:
    """Whether ``source`` holds a lone surrogate escape or a run of ``LONG_NUMBER`` digits; it is
    read back to its start. A surrogate escape near a chunk's end is judged with the next chunk."""
    tail, judged = b"", 0  # the previous window's end; how much of it was judged for surrogates
    found = False
    while not found:
        chunk = source.read(CHUNK)
        window = tail + chunk
        end = len(window) - SURROGATE_SPAN if chunk else len(window)  # a match from here may need more
        found = LONG_NUMBER in window.translate(ZEROS) or _lone_surrogate(window, judged, end)
        if not chunk:
            break
        digits = len(window) - len(window.rstrip(b"0123456789"))  # a run of digits goes on in the next chunk
        tail = window[-max(2 * SURROGATE_SPAN, digits):]
        judged = max(len(tail) - SURROGATE_SPAN, 0)
    source.seek(0)
    return found


def _lone_surrogate(window: bytes, start: int, end: int) -> bool:
    """Whether a surrogate escape that is no half of a pair starts in ``window[start:end]``."""
    if SURROGATE.search(window, start) is None:
        return False
    lone = SURROGATE.search(PAIR.sub(b"_" * SURROGATE_SPAN, window), start)  # the pairs blanked out, in place
    return lone is not None and lone.start() < end


def read_requests(source: BinaryIO, out: BinaryIO, max_line_bytes: int, max_requests: int,
                  max_file_bytes: int) -> Written:
    """Write the lines of the body in ``source`` (seekable) to ``out``, at most ``max_file_bytes``
    of them (the rest only counted); InvalidRequest for the first refusal, as the module says."""
    return Reader(out, max_line_bytes, max_requests, max_file_bytes).read(events(source))

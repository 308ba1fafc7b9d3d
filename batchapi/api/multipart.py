"""``POST /v1/files`` (and an Upload's part, ``POST /v1/uploads/{id}/parts``): the multipart form
parsed as it streams in, its ``file`` (``data``) part handed to storage chunk by chunk, never spooled
to a temporary file, so the upload limit holds from the first byte. (``limits.BodyLimit`` bounds the
whole body; this bounds the file, the fields and the parts.)"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator

import anyio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from batchapi.batches import files
from batchapi.context import Context
from batchapi.db.models import File
from batchapi.errors import InvalidRequest
from batchapi.storage.streams import ChunkReader, TooLarge

FORM_OVERHEAD_BYTES = 64 * 1024  # a form's bytes besides the file: boundaries, part headers, fields
MAX_PARTS = 8
EXPIRES_FIELDS = ("anchor", "seconds")  # the SDK sends ``expires_after`` as expires_after[anchor], [seconds]
MAX_FIELD_BYTES = 1024  # one field besides the file (``purpose``)
IDLE_SECONDS = 60.0  # an upload that sends nothing for this long is given up
MAX_CONCURRENT_UPLOADS = 16  # storing at once, each on a thread of its own; more wait their turn


async def receive_upload(request: Request, ctx: Context, project_id: str) -> File:
    """Store the request's file as a File of ``project_id``, read as it arrives."""
    form = UploadForm(request, ctx.settings.max_upload_bytes)
    limiter = request.app.state.upload_limiter  # MAX_CONCURRENT_UPLOADS, made with the app
    return await anyio.to_thread.run_sync(store, ctx, project_id, form, limiter=limiter)


def store(ctx: Context, project_id: str, form: UploadForm) -> File:
    filename = form.open_file()
    # a form may send its fields after the file: then they are checked once the file is read
    purpose = form.fields["purpose"] if "purpose" in form.fields else form.purpose
    early = any(f"expires_after[{name}]" in form.fields for name in EXPIRES_FIELDS)
    expires_after = form.expires_after() if early else form.expires_after
    return files.upload_file(ctx, project_id, filename, purpose, ChunkReader(form.file_chunks()), expires_after)


class UploadForm:
    """A multipart/form-data request body, parsed on a worker thread that pulls the body from the
    event loop as it goes. ``open_file`` reads up to the ``file`` part and names the file;
    ``file_chunks`` then yields that part's bytes and, at its end, reads the rest of the form, so
    ``fields`` is complete once the file has been read."""

    def __init__(self, request: Request, limit: int, file_field: str = "file"):
        kind, options = parse_options_header(request.headers.get("content-type"))
        if kind != b"multipart/form-data" or not options.get(b"boundary"):
            what = "a 'file' and a 'purpose'" if file_field == "file" else f"a {file_field!r} field"
            raise InvalidRequest(f"An upload is a multipart/form-data body with {what}.", file_field)
        self.file_field = file_field
        callbacks = {
            "on_part_begin": self._on_part_begin, "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value, "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished, "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end, "on_end": self._on_end,
        }
        try:
            self._parser = MultipartParser(options[b"boundary"], callbacks)
        except FormParserError as exc:  # a boundary too long
            raise InvalidRequest(f"The multipart boundary is not usable: {exc}", "file") from None
        self.limit = limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self._loop = asyncio.get_running_loop()
        self._body = request.stream()
        self._pending: deque[bytes] = deque()  # file bytes parsed, not yet read
        self._file_bytes = 0
        self._file_done = self._ended = self._drained = False
        self._parts = 0
        # the part being parsed
        self._header_name = self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name = ""
        self._in_file = False
        self._value = bytearray()

    def open_file(self) -> str:
        while self.filename is None:
            if self._drained:
                raise InvalidRequest(f"The form has no {self.file_field!r} field.", self.file_field)
            self._feed()
        return self.filename

    def file_chunks(self) -> Iterator[bytes]:
        while self._pending or not self._file_done:
            if self._pending:
                yield self._pending.popleft()
            else:
                self._feed()
        while not self._drained:  # the fields after the file
            self._feed()

    def purpose(self) -> str:
        if "purpose" not in self.fields:
            raise InvalidRequest("The form has no 'purpose' field.", "purpose")
        return self.fields["purpose"]

    def expires_after(self) -> int | None:
        """The seconds of ``expires_after[anchor]`` and ``expires_after[seconds]``, checked; None if absent."""
        value = {name: self.fields[f"expires_after[{name}]"] for name in EXPIRES_FIELDS
                 if f"expires_after[{name}]" in self.fields}
        return files.expiry_seconds(value or None, "expires_after")

    # pulling the body

    def _feed(self) -> None:
        chunk = asyncio.run_coroutine_threadsafe(self._next_chunk(), self._loop).result(IDLE_SECONDS + 10)
        if chunk is None:
            self._drained = True
            if not self._ended:
                raise InvalidRequest("The multipart body ends before its closing boundary.", self.file_field)
            return
        try:
            self._parser.write(chunk)
        except FormParserError as exc:
            raise InvalidRequest(f"The multipart body is malformed: {exc}", self.file_field) from None

    async def _next_chunk(self) -> bytes | None:
        """The body's next bytes; None at its end."""
        try:
            while True:
                chunk = await asyncio.wait_for(anext(self._body, None), IDLE_SECONDS)
                if chunk != b"":  # Starlette's stream ends with an empty chunk
                    return chunk
        except ClientDisconnect:
            raise InvalidRequest("The client went away before the upload ended.", "file") from None
        except TimeoutError:
            raise InvalidRequest(f"The upload sent nothing for {IDLE_SECONDS:.0f} seconds.", "file") from None

    # the parser's callbacks

    def _on_part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise InvalidRequest(f"The form has more than {MAX_PARTS} fields.", None)
        self._headers, self._name, self._value = {}, "", bytearray()

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        self._headers[self._header_name.lower()] = self._header_value
        self._header_name = self._header_value = b""

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if self._name != self.file_field:
            return
        if self.filename is not None:
            raise InvalidRequest(f"The form has more than one {self.file_field!r} field.", self.file_field)
        self.filename = options.get(b"filename", b"").decode("utf-8", "replace")
        self._in_file = True

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self._file_bytes += end - start
            if self._file_bytes > self.limit:
                raise TooLarge(f"The {'file' if self.file_field == 'file' else 'part'} is larger than the upload "
                               f"limit of {self.limit} bytes.", self.file_field)
            self._pending.append(data[start:end])
        elif len(self._value) + end - start > MAX_FIELD_BYTES:
            raise InvalidRequest(f"The form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes.", self._name)
        else:
            self._value += data[start:end]

    def _on_part_end(self) -> None:
        if self._in_file:
            self._in_file, self._file_done = False, True
        elif self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")

    def _on_end(self) -> None:
        self._ended = True

"""The Files service: upload, list, retrieve, stream content, delete; and expiry: a file's
``expires_at`` (``expires_after``, as OpenAI's: anchor ``created_at``, 1 hour to 30 days; a batch
input file expires after 30 days unless told otherwise), past which it is gone for the API at once
and the sweeper deletes its object and row (``remove_expired``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import BinaryIO

from sqlalchemy import delete, exists, or_, select
from sqlalchemy.orm import Session

from batchapi.batches.states import ACTIVE
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.ids import file_id
from batchapi.db.models import Batch, File
from batchapi.db.paging import page
from batchapi.db.session import session_scope
from batchapi.errors import InvalidRequest, NotFound
from batchapi.openai.text import check_text
from batchapi.storage.keys import file_key
from batchapi.storage.streams import LimitedReader

UPLOAD_PURPOSES = ("batch",)
MAX_FILENAME = 512  # characters, as the column holds
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MIN_EXPIRY_SECONDS = 3600
MAX_EXPIRY_SECONDS = 30 * 86400
BATCH_INPUT_EXPIRY_SECONDS = 30 * 86400  # OpenAI's default for purpose=batch
EXPIRY_ANCHORS = ("created_at",)
REMOVE_PER_SWEEP = 500


def upload_file(
    ctx: Context, project_id: str, filename: str, purpose: str | Callable[[], str], stream: BinaryIO,
    expires_after: int | None | Callable[[], int | None] = None, max_bytes: int | None = None,
) -> File:
    """Store ``stream`` as a new File. ``purpose`` and ``expires_after`` (seconds, already checked
    by ``expiry_seconds``) may be callables that tell them once ``stream`` has been read (a form
    may send its fields after the file); a bad one removes the object. ``max_bytes``: the limit on
    the file, if not ``max_upload_bytes`` (a Message Batch's own)."""
    if isinstance(purpose, str):
        check_purpose(purpose)
    check_filename(filename)
    fid = file_id()
    key = file_key(fid)
    limit = ctx.settings.max_upload_bytes if max_bytes is None else max_bytes
    size = ctx.storage.put_stream(key, LimitedReader(stream, limit))
    try:
        if callable(purpose):
            purpose = purpose()
            check_purpose(purpose)
        if callable(expires_after):
            expires_after = expires_after()
    except InvalidRequest:
        ctx.storage.delete(key)
        raise
    with session_scope(ctx.sessions) as session:
        return add_file(session, project_id, filename, purpose, key, size, expires_after, fid)


def add_file(session: Session, project_id: str, filename: str, purpose: str, key: str, size: int,
             expires_after: int | None, fid: str | None = None) -> File:
    """The row of an upload stored under ``key`` (checked already); the caller commits."""
    t = now()
    row = File(
        id=fid or file_id(), project_id=project_id, filename=filename.replace("\x00", "")[:512], purpose=purpose,
        bytes=size, storage_key=key, created_at=t, expires_at=expires_at_for(purpose, expires_after, t),
    )
    session.add(row)
    return row


def check_purpose(purpose: str) -> None:
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"'{purpose}' is not a supported purpose; expected 'batch'", "purpose")


def check_filename(filename: str, param: str = "file") -> None:
    """A file name of 1 to ``MAX_FILENAME`` characters, none of them a control character (NUL, a newline)."""
    if not filename:
        raise InvalidRequest("the upload needs a file name", param)
    check_text(filename, param)
    if len(filename) > MAX_FILENAME:
        raise InvalidRequest(f"the file name is {len(filename)} characters long; at most {MAX_FILENAME} are allowed",
                             param)
    bad = CONTROL.search(filename)
    if bad is not None:
        raise InvalidRequest(f"the file name holds the control character {bad.group()!r} at {bad.start()}", param)


def expiry_seconds(value: dict | None, param: str) -> int | None:
    """``{"anchor": "created_at", "seconds": N}`` (``expires_after``, ``output_expires_after``),
    checked as OpenAI checks it; the seconds, or None when not given."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be an object with 'anchor' and 'seconds'", param)
    anchor, seconds = value.get("anchor"), value.get("seconds")
    if anchor not in EXPIRY_ANCHORS:
        raise InvalidRequest(f"{param}.anchor must be 'created_at', not {anchor!r}", f"{param}.anchor")
    if isinstance(seconds, str) and seconds.strip().isdigit():  # a form field
        seconds = int(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not (
            MIN_EXPIRY_SECONDS <= seconds <= MAX_EXPIRY_SECONDS):
        raise InvalidRequest(f"{param}.seconds must be an integer between {MIN_EXPIRY_SECONDS} (1 hour) and "
                             f"{MAX_EXPIRY_SECONDS} (30 days), not {seconds!r}", f"{param}.seconds")
    return seconds


def expires_at_for(purpose: str, expires_after: int | None, created_at: int) -> int | None:
    if expires_after is not None:
        return created_at + expires_after
    return created_at + BATCH_INPUT_EXPIRY_SECONDS if purpose == "batch" else None


def register_file(session: Session, project_id: str, filename: str, purpose: str, storage_key: str, size: int) -> File:
    """Record an object already in storage (a batch's output or error file); caller commits."""
    row = File(
        id=file_id(), project_id=project_id, filename=filename, purpose=purpose, bytes=size,
        storage_key=storage_key, created_at=now(),
    )
    session.add(row)
    return row


def get_file_row(session: Session, project_id: str, fid: str, *, lock: bool = False, gone: bool = False) -> File:
    """The file, unless it is another project's, deleted or expired (NotFound). ``lock`` holds a
    shared lock on its row until the caller commits, so ``remove_expired`` cannot remove it
    meanwhile (``create_batch``, on PostgreSQL; SQLite has one writer at a time anyway). ``gone``: a
    deleted or expired one too, while its row is there (a listing's cursor still marks its place,
    so a client that deletes what it lists pages on)."""
    if lock:
        row = session.scalar(select(File).where(File.id == fid).with_for_update(read=True)
                             .execution_options(populate_existing=True))
    else:
        row = session.get(File, fid)
    if row is None or row.project_id != project_id or (
            not gone and (row.deleted_at is not None or _expired(row, now()))):
        raise NotFound(f"No such File object: {fid}", "id")
    return row


def _expired(row: File, t: int) -> bool:
    return row.expires_at is not None and row.expires_at <= t


def get_file(ctx: Context, project_id: str, fid: str) -> File:
    with ctx.sessions() as session:
        return get_file_row(session, project_id, fid)


def list_files(
    ctx: Context, project_id: str, limit: int, after: str | None, order: str, purpose: str | None
) -> tuple[list[File], bool]:
    """Up to ``limit`` files after the cursor ``after`` (a file id), and whether more follow."""
    with ctx.sessions() as session:
        cursor = get_file_row(session, project_id, after, gone=True) if after else None
        query = select(File).where(File.project_id == project_id, File.deleted_at.is_(None),
                                   or_(File.expires_at.is_(None), File.expires_at > now()))
        if purpose:
            query = query.where(File.purpose == purpose)
        return page(session, query, File, cursor, limit, newest_first=order == "desc")


def open_content(ctx: Context, project_id: str, fid: str) -> tuple[File, Iterator[bytes]]:
    row = get_file(ctx, project_id, fid)
    ctx.storage.size(row.storage_key)  # NotFound now, before a response has started
    return row, ctx.storage.iter_chunks(row.storage_key)


def delete_file(ctx: Context, project_id: str, fid: str) -> str:
    with session_scope(ctx.sessions) as session:
        row = get_file_row(session, project_id, fid)
        row.deleted_at = now()
        in_use = session.scalar(
            select(Batch.id).where(Batch.input_file_id == fid, Batch.status.in_(sorted(ACTIVE))).limit(1)
        )
        key = row.storage_key
    if in_use is None:  # a running batch still reads its input; the object stays until then
        ctx.storage.delete(key)
    return fid


def remove_expired(ctx: Context, each: Callable[[list, str, Callable], None]) -> list[str]:
    """The sweeper's step: files past ``expires_at``, and deleted ones whose object a running
    batch kept, lose their object and then their row, unless a batch still running reads them
    (they go once it ends). ``each(rows, what, act)`` runs ``act`` on every row alone."""
    t = now()
    in_use = exists().where(Batch.input_file_id == File.id, Batch.status.in_(sorted(ACTIVE)))
    gone = or_(File.expires_at <= t, File.deleted_at.is_not(None))
    with ctx.sessions() as session:
        rows = session.execute(
            select(File.id, File.storage_key).where(gone, ~in_use).order_by(File.expires_at).limit(REMOVE_PER_SWEEP)
        ).all()
    removed: list[str] = []

    def remove(row) -> None:
        fid, key = row
        with session_scope(ctx.sessions) as session:
            # the row goes first, uncommitted: that waits for (or blocks) a create_batch naming the
            # file, which locks the row after adding its batch; the check below then sees that batch
            if session.execute(delete(File).where(File.id == fid, gone)).rowcount != 1:
                return
            if session.scalar(select(Batch.id).where(Batch.input_file_id == fid,
                                                     Batch.status.in_(sorted(ACTIVE))).limit(1)) is not None:
                session.rollback()  # a batch was created from it meanwhile: it goes once that ends
                return
            shared = session.scalar(select(File.id).where(File.storage_key == key, File.id != fid).limit(1))
            if shared is None:  # no other file row names the same object
                ctx.storage.delete(key)  # before the commit: a failed delete leaves the row to retry
        removed.append(fid)

    each(rows, "removing the expired file", remove)
    return removed

"""Uploads, as OpenAI's: create one (its final size, name, purpose and MIME type; the name and the
purpose checked as ``POST /v1/files`` checks them), add parts of up to 64 MB (8 GB in all) within
an hour, in any order and in parallel, then complete it with the ordered ``part_ids`` (and
optionally the whole file's ``md5``) or cancel it.

Each part is streamed into an object of its own (``upload_part_key``); completing composes them,
in the order given, into the new File's object (``Storage.compose``: on S3 a multipart upload of
server-side part copies) and records the File as ``POST /v1/files`` would, with the same checks.
Every change of an Upload's status is a conditional UPDATE from ``pending``, so a complete racing
a cancel, or two completes, have one winner; the loser's composed object is removed. Parts of an
Upload that is no longer pending are deleted (at once, or by the sweeper's ``expire_uploads`` when
a process died first)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from enum import StrEnum
from typing import BinaryIO

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from batchapi.batches import files
from batchapi.context import Context
from batchapi.db.clock import now
from batchapi.db.ids import file_id, new_id
from batchapi.db.models import File, Upload, UploadPart
from batchapi.db.session import session_scope
from batchapi.errors import InvalidRequest, NotFound
from batchapi.storage.keys import file_key, upload_part_key

MAX_UPLOAD_BYTES = 8 * 1024**3
MAX_PART_BYTES = 64 * 1024**2
MAX_PARTS = 10_000
UPLOAD_SECONDS = 3600  # to complete an Upload, from its creation
MAX_MIME_TYPE = 255
# RFC 6838's type/subtype names, then any parameters (``; charset=utf-8``) in printable ASCII
MIME_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]*(?:\s*;[\x20-\x7e]*)?")
EXPIRE_PER_SWEEP = 200


class UploadStatus(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


def create_upload(ctx: Context, project_id: str, filename: str, purpose: str, size: int, mime_type: str,
                  expires_after: dict | None = None) -> Upload:
    files.check_purpose(purpose)
    files.check_filename(filename, "filename")
    if not isinstance(mime_type, str) or not 0 < len(mime_type) <= MAX_MIME_TYPE:
        raise InvalidRequest(f"mime_type must be a string of 1 to {MAX_MIME_TYPE} characters", "mime_type")
    if not MIME_TYPE.fullmatch(mime_type):
        raise InvalidRequest(f"mime_type {mime_type!r} is not a MIME type (type/subtype, e.g. 'application/jsonl')",
                             "mime_type")
    if isinstance(size, bool) or not isinstance(size, int):
        raise InvalidRequest("bytes must be an integer", "bytes")
    if not 0 < size <= MAX_UPLOAD_BYTES:
        raise InvalidRequest(f"bytes must be between 1 and {MAX_UPLOAD_BYTES} (8 GB)", "bytes")
    limit = ctx.settings.max_file_bytes  # what validation takes of a batch input file
    if size > limit:
        raise InvalidRequest(f"bytes {size} is over the limit of {limit} bytes for a file of purpose '{purpose}'",
                             "bytes", "file_too_large")
    seconds = files.expiry_seconds(expires_after, "expires_after")
    t = now()
    row = Upload(
        id=new_id("upload_"), project_id=project_id, filename=filename, purpose=purpose,
        mime_type=mime_type, bytes=size, status=UploadStatus.PENDING, file_expires_after=seconds, created_at=t,
        expires_at=t + UPLOAD_SECONDS,
    )
    with session_scope(ctx.sessions) as session:
        session.add(row)
    return row


def get_upload(ctx: Context, project_id: str, upload_id: str) -> tuple[Upload, File | None]:
    """The Upload and, once completed, its File."""
    with ctx.sessions() as session:
        upload = _upload(session, project_id, upload_id)
        return upload, session.get(File, upload.file_id) if upload.file_id else None


def _upload(session: Session, project_id: str, upload_id: str, *, lock: bool = False) -> Upload:
    query = select(Upload).where(Upload.id == upload_id, Upload.project_id == project_id)
    upload = session.scalar(query.with_for_update() if lock else query)
    if upload is None:
        raise NotFound(f"No such Upload: {upload_id}", "upload_id")
    return upload


def _check_open(upload: Upload, t: int) -> None:
    if upload.status == UploadStatus.PENDING and upload.expires_at <= t:
        raise InvalidRequest(f"Upload {upload.id} expired: an Upload must be completed within an hour of its "
                             "creation", "upload_id", "upload_expired")
    if upload.status != UploadStatus.PENDING:
        raise InvalidRequest(f"Upload {upload.id} is {upload.status}, not pending", "upload_id",
                             f"upload_{upload.status}")


def add_part(ctx: Context, project_id: str, upload_id: str, stream: BinaryIO) -> UploadPart:
    """Store one part (the form bounds it to ``MAX_PART_BYTES``) and record it, unless the parts
    would then hold more than the Upload's ``bytes``."""
    with ctx.sessions() as session:
        _check_open(_upload(session, project_id, upload_id), now())
    part_id = new_id("part_")
    key = upload_part_key(upload_id, part_id)
    size = ctx.storage.put_stream(key, stream)
    try:
        with session_scope(ctx.sessions) as session:
            upload = _upload(session, project_id, upload_id, lock=True)  # parallel parts add up one at a time
            _check_open(upload, now())
            count, held = session.execute(
                select(func.count(), func.coalesce(func.sum(UploadPart.bytes), 0)).where(UploadPart.upload_id == upload_id)
            ).one()
            if count >= MAX_PARTS:
                raise InvalidRequest(f"an Upload takes at most {MAX_PARTS} parts", "data")
            if held + size > upload.bytes:
                raise InvalidRequest(f"with this part of {size} bytes the parts would hold {held + size} bytes, more "
                                     f"than the {upload.bytes} the Upload was created with", "data")
            part = UploadPart(id=part_id, upload_id=upload_id, bytes=size, storage_key=key, created_at=now())
            session.add(part)
    except BaseException:
        ctx.storage.delete(key)
        raise
    return part


def complete_upload(ctx: Context, project_id: str, upload_id: str, part_ids: list[str],
                    md5: str | None = None) -> tuple[Upload, File]:
    t = now()
    with ctx.sessions() as session:
        upload = _upload(session, project_id, upload_id)
        _check_open(upload, t)
        parts = {p.id: p for p in session.scalars(select(UploadPart).where(UploadPart.upload_id == upload_id))}
    ordered = _ordered_parts(upload, parts, part_ids)
    fid = file_id()
    key = file_key(fid)
    size = ctx.storage.compose(key, [p.storage_key for p in ordered])
    try:
        if md5 is not None:
            _check_md5(ctx, key, md5)
        with session_scope(ctx.sessions) as session:
            if not _finish(session, upload_id, UploadStatus.COMPLETED, file_id=fid):
                _check_open(session.get(Upload, upload_id), now())  # says why it is no longer pending
                raise AssertionError(f"upload {upload_id} left pending without a status")
            file = files.add_file(session, project_id, upload.filename, upload.purpose, key, size,
                                  upload.file_expires_after, fid)
    except BaseException:
        ctx.storage.delete(key)
        raise
    _remove_parts(ctx, upload_id)
    with ctx.sessions() as session:
        return session.get(Upload, upload_id), file


def _ordered_parts(upload: Upload, parts: dict[str, UploadPart], part_ids: list[str]) -> list[UploadPart]:
    """The parts ``part_ids`` names, in its order: each a part of this Upload, named once, adding
    up to the Upload's ``bytes``."""
    if not part_ids:
        raise InvalidRequest("part_ids must name the Upload's parts in the order of the file", "part_ids")
    seen: set[str] = set()
    for index, pid in enumerate(part_ids):
        if pid not in parts:
            raise InvalidRequest(f"part_ids[{index}] {pid!r} is not a part of Upload {upload.id}", "part_ids")
        if pid in seen:
            raise InvalidRequest(f"part_ids[{index}] {pid!r} is named more than once", "part_ids")
        seen.add(pid)
    total = sum(parts[pid].bytes for pid in part_ids)
    if total != upload.bytes:
        raise InvalidRequest(f"the parts named hold {total} bytes, but the Upload was created with bytes "
                             f"{upload.bytes}", "part_ids", "upload_size_mismatch")
    return [parts[pid] for pid in part_ids]


def _check_md5(ctx: Context, key: str, md5: str) -> None:
    digest = hashlib.md5(usedforsecurity=False)
    for chunk in ctx.storage.iter_chunks(key):
        digest.update(chunk)
    if digest.hexdigest() != md5.strip().lower():
        raise InvalidRequest(f"md5 {md5!r} does not match the parts' md5 {digest.hexdigest()}", "md5", "md5_mismatch")


def cancel_upload(ctx: Context, project_id: str, upload_id: str) -> Upload:
    with session_scope(ctx.sessions) as session:
        _upload(session, project_id, upload_id)
        if not _finish(session, upload_id, UploadStatus.CANCELLED):
            status = session.scalar(select(Upload.status).where(Upload.id == upload_id))
            raise InvalidRequest(f"Upload {upload_id} is {status} and cannot be cancelled", "upload_id",
                                 f"upload_{status}")
    _remove_parts(ctx, upload_id)
    with ctx.sessions() as session:
        return session.get(Upload, upload_id)


def _finish(session: Session, upload_id: str, status: UploadStatus, **values) -> bool:
    """The one way out of ``pending``: a conditional UPDATE; whether this call made it."""
    return session.execute(
        update(Upload).where(Upload.id == upload_id, Upload.status == UploadStatus.PENDING)
        .values(status=status, **values).execution_options(synchronize_session=False)
    ).rowcount == 1


def _remove_parts(ctx: Context, upload_id: str) -> None:
    with ctx.sessions() as session:
        parts = session.execute(select(UploadPart.id, UploadPart.storage_key).where(UploadPart.upload_id == upload_id)).all()
    for part_id, key in parts:
        ctx.storage.delete(key)
        with session_scope(ctx.sessions) as session:
            session.execute(delete(UploadPart).where(UploadPart.id == part_id))


def expire_uploads(ctx: Context, each: Callable[[list, str, Callable], None]) -> list[str]:
    """The sweeper's step: pending Uploads past their hour become ``expired``, and every Upload no
    longer pending loses the parts still left (a process died before deleting them)."""
    t = now()
    with session_scope(ctx.sessions) as session:
        late = list(session.scalars(select(Upload.id).where(
            Upload.status == UploadStatus.PENDING, Upload.expires_at <= t).limit(EXPIRE_PER_SWEEP)))
        expired = [upload_id for upload_id in late if _finish(session, upload_id, UploadStatus.EXPIRED)]
    with ctx.sessions() as session:
        leftover = list(session.scalars(
            select(UploadPart.upload_id).join(Upload, Upload.id == UploadPart.upload_id)
            .where(Upload.status != UploadStatus.PENDING).distinct().limit(EXPIRE_PER_SWEEP)
        ))
    each(leftover, "removing the parts of upload", lambda upload_id: _remove_parts(ctx, upload_id))
    return expired

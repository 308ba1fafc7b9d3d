"""The Files service: upload, list, retrieve, stream content, delete."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchapi.batches.context import Jobs
from batchapi.batches.states import ACTIVE
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


def upload_file(
    jobs: Jobs, project_id: str, filename: str, purpose: str | Callable[[], str], stream: BinaryIO
) -> File:
    """Store ``stream`` as a new File. ``purpose`` may be a callable that tells it once ``stream``
    has been read (a form may send the purpose after the file); a bad one removes the object."""
    if isinstance(purpose, str):
        _check_purpose(purpose)
    if not filename:
        raise InvalidRequest("the upload needs a file name", "file")
    check_text(filename, "file")
    fid = file_id()
    key = file_key(fid)
    size = jobs.storage.put_stream(key, LimitedReader(stream, jobs.settings.max_upload_bytes))
    if not isinstance(purpose, str):
        try:
            purpose = purpose()
            _check_purpose(purpose)
        except InvalidRequest:
            jobs.storage.delete(key)
            raise
    row = File(
        id=fid, project_id=project_id, filename=filename.replace("\x00", "")[:512], purpose=purpose, bytes=size,
        storage_key=key, created_at=now(),
    )
    with session_scope(jobs.sessions) as session:
        session.add(row)
    return row


def _check_purpose(purpose: str) -> None:
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"'{purpose}' is not a supported purpose; expected 'batch'", "purpose")


def register_file(session: Session, project_id: str, filename: str, purpose: str, storage_key: str, size: int) -> File:
    """Record an object already in storage (a batch's output or error file); caller commits."""
    row = File(
        id=file_id(), project_id=project_id, filename=filename, purpose=purpose, bytes=size,
        storage_key=storage_key, created_at=now(),
    )
    session.add(row)
    return row


def get_file_row(session: Session, project_id: str, fid: str) -> File:
    row = session.get(File, fid)
    if row is None or row.project_id != project_id or row.deleted_at is not None:
        raise NotFound(f"No such File object: {fid}", "id")
    return row


def get_file(jobs: Jobs, project_id: str, fid: str) -> File:
    with jobs.sessions() as session:
        return get_file_row(session, project_id, fid)


def list_files(
    jobs: Jobs, project_id: str, limit: int, after: str | None, order: str, purpose: str | None
) -> tuple[list[File], bool]:
    """Up to ``limit`` files after the cursor ``after`` (a file id), and whether more follow."""
    with jobs.sessions() as session:
        cursor = get_file_row(session, project_id, after) if after else None
        query = select(File).where(File.project_id == project_id, File.deleted_at.is_(None))
        if purpose:
            query = query.where(File.purpose == purpose)
        return page(session, query, File, cursor, limit, newest_first=order == "desc")


def open_content(jobs: Jobs, project_id: str, fid: str) -> tuple[File, Iterator[bytes]]:
    row = get_file(jobs, project_id, fid)
    jobs.storage.size(row.storage_key)  # NotFound now, before a response has started
    return row, jobs.storage.iter_chunks(row.storage_key)


def delete_file(jobs: Jobs, project_id: str, fid: str) -> str:
    with session_scope(jobs.sessions) as session:
        row = get_file_row(session, project_id, fid)
        row.deleted_at = now()
        in_use = session.scalar(
            select(Batch.id).where(Batch.input_file_id == fid, Batch.status.in_(sorted(ACTIVE))).limit(1)
        )
        key = row.storage_key
    if in_use is None:  # a running batch still reads its input; the object stays until then
        jobs.storage.delete(key)
    return fid

"""Request and response bodies of the Uploads API, in the shapes of OpenAI's."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from batchapi.api.schemas import ExpiresAfter, FileObject
from batchapi.db.models import File, Upload, UploadPart


class CreateUploadRequest(BaseModel):
    """Checked as OpenAI checks it: no unknown fields, ``bytes`` an integer (not "10" or true); the
    values themselves by ``batches.uploads.create_upload``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    bytes: int
    filename: str
    mime_type: str
    purpose: str
    expires_after: ExpiresAfter | None = None  # of the File it makes


class CompleteUploadRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    part_ids: list[str]
    md5: str | None = None


class UploadObject(BaseModel):
    id: str
    object: Literal["upload"] = "upload"
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    file: FileObject | None = None

    @classmethod
    def of(cls, row: Upload, file: File | None = None) -> UploadObject:
        return cls(id=row.id, bytes=row.bytes, created_at=row.created_at, expires_at=row.expires_at,
                   filename=row.filename, purpose=row.purpose, status=row.status,
                   file=FileObject.of(file) if file is not None else None)


class UploadPartObject(BaseModel):
    id: str
    object: Literal["upload.part"] = "upload.part"
    created_at: int
    upload_id: str

    @classmethod
    def of(cls, row: UploadPart) -> UploadPartObject:
        return cls(id=row.id, created_at=row.created_at, upload_id=row.upload_id)

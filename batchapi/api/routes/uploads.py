"""OpenAI's Uploads API: ``POST /v1/uploads``, ``/{id}/parts``, ``/{id}/complete``, ``/{id}/cancel``."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request

from batchapi.api.deps import ContextDep, ProjectDep
from batchapi.api.multipart import UploadForm
from batchapi.api.schemas import error_responses
from batchapi.api.upload_schemas import (
    CompleteUploadRequest,
    CreateUploadRequest,
    UploadObject,
    UploadPartObject,
)
from batchapi.batches import uploads
from batchapi.batches.uploads import MAX_PART_BYTES
from batchapi.context import Context
from batchapi.db.models import UploadPart
from batchapi.storage.streams import ChunkReader

router = APIRouter(prefix="/v1/uploads", tags=["uploads"], responses=error_responses(400, 401, 431))
PARTS_PATH = "/v1/uploads/*/parts"  # the body limit of a part (``limits.BodyLimit``)

PART_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "format": "binary", "description": "The part's bytes, up to 64 MB."}},
}}}}}


@router.post("")
def create_upload(ctx: ContextDep, project_id: ProjectDep, body: CreateUploadRequest) -> UploadObject:
    expires_after = body.expires_after.model_dump() if body.expires_after is not None else None
    return UploadObject.of(uploads.create_upload(ctx, project_id, body.filename, body.purpose, body.bytes,
                                                 body.mime_type, expires_after))


@router.post("/{upload_id}/parts", responses=error_responses(404, 413, 503), openapi_extra=PART_FORM)
async def add_part(request: Request, ctx: ContextDep, project_id: ProjectDep, upload_id: str) -> UploadPartObject:
    form = UploadForm(request, MAX_PART_BYTES, file_field="data")
    part = await anyio.to_thread.run_sync(_store_part, ctx, project_id, upload_id, form,
                                          limiter=request.app.state.upload_limiter)
    return UploadPartObject.of(part)


def _store_part(ctx: Context, project_id: str, upload_id: str, form: UploadForm) -> UploadPart:
    form.open_file()
    return uploads.add_part(ctx, project_id, upload_id, ChunkReader(form.file_chunks()))


@router.post("/{upload_id}/complete", responses=error_responses(404, 503))
def complete_upload(ctx: ContextDep, project_id: ProjectDep, upload_id: str, body: CompleteUploadRequest) -> UploadObject:
    upload, file = uploads.complete_upload(ctx, project_id, upload_id, body.part_ids, body.md5)
    return UploadObject.of(upload, file)


@router.post("/{upload_id}/cancel", responses=error_responses(404, 503))
def cancel_upload(ctx: ContextDep, project_id: ProjectDep, upload_id: str) -> UploadObject:
    return UploadObject.of(uploads.cancel_upload(ctx, project_id, upload_id))

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from batchapi.api.deps import ContextDep, ProjectDep
from batchapi.api.multipart import receive_upload
from batchapi.api.schemas import FileDeleted, FileList, FileObject, error_responses
from batchapi.batches import files

router = APIRouter(prefix="/v1/files", tags=["files"], responses=error_responses(400, 401, 431))

# the form is parsed by hand as it streams in (api/multipart.py), so it is described here
UPLOAD_FORM = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "The JSONL file."},
        "purpose": {"type": "string", "enum": ["batch"]},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000,
                                   "description": "The file expires this long after it is made (default for "
                                                  "purpose=batch: 30 days)."},
    },
}}}}}


@router.post("", responses=error_responses(413, 503), openapi_extra=UPLOAD_FORM)
async def upload_file(request: Request, ctx: ContextDep, project_id: ProjectDep) -> FileObject:
    return FileObject.of(await receive_upload(request, ctx, project_id))


@router.get("", responses=error_responses(404))
def list_files(
    ctx: ContextDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> FileList:
    rows, has_more = files.list_files(ctx, project_id, limit, after, order, purpose)
    return FileList.of([FileObject.of(r) for r in rows], has_more)


@router.get("/{file_id}", responses=error_responses(404))
def retrieve_file(ctx: ContextDep, project_id: ProjectDep, file_id: str) -> FileObject:
    return FileObject.of(files.get_file(ctx, project_id, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse, responses=error_responses(404, 503))
def file_content(ctx: ContextDep, project_id: ProjectDep, file_id: str) -> StreamingResponse:
    row, chunks = files.open_content(ctx, project_id, file_id)
    return StreamingResponse(
        chunks, media_type="application/octet-stream",
        headers={"Content-Length": str(row.bytes), "Content-Disposition": f'attachment; filename="{row.id}.jsonl"'},
    )


@router.delete("/{file_id}", responses=error_responses(404, 503))
def delete_file(ctx: ContextDep, project_id: ProjectDep, file_id: str) -> FileDeleted:
    return FileDeleted(id=files.delete_file(ctx, project_id, file_id))

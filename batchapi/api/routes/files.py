from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import StreamingResponse

from batchapi.api.deps import JobsDep, ProjectDep
from batchapi.api.schemas import FileDeleted, FileList, FileObject
from batchapi.batches import files

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post("")
def upload_file(jobs: JobsDep, project_id: ProjectDep, file: UploadFile, purpose: Annotated[str, Form()]) -> FileObject:
    row = files.upload_file(jobs, project_id, file.filename or "", purpose, file.file)
    return FileObject.of(row)


@router.get("")
def list_files(
    jobs: JobsDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> FileList:
    rows, has_more = files.list_files(jobs, project_id, limit, after, order, purpose)
    return FileList.of([FileObject.of(r) for r in rows], has_more)


@router.get("/{file_id}")
def retrieve_file(jobs: JobsDep, project_id: ProjectDep, file_id: str) -> FileObject:
    return FileObject.of(files.get_file(jobs, project_id, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse)
def file_content(jobs: JobsDep, project_id: ProjectDep, file_id: str) -> StreamingResponse:
    row, chunks = files.open_content(jobs, project_id, file_id)
    return StreamingResponse(
        chunks, media_type="application/octet-stream",
        headers={"Content-Length": str(row.bytes), "Content-Disposition": f'attachment; filename="{row.id}.jsonl"'},
    )


@router.delete("/{file_id}")
def delete_file(jobs: JobsDep, project_id: ProjectDep, file_id: str) -> FileDeleted:
    return FileDeleted(id=files.delete_file(jobs, project_id, file_id))

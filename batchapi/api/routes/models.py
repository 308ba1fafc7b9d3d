from __future__ import annotations

from fastapi import APIRouter, Request

from batchapi.api.deps import ProjectDep
from batchapi.api.schemas import ModelList, ModelObject, error_responses
from batchapi.errors import NotFound
from batchapi.models.registry import served_id_for

router = APIRouter(prefix="/v1/models", tags=["models"], responses=error_responses(400, 401, 431))


@router.get("")
def list_models(request: Request, _project_id: ProjectDep) -> ModelList:
    return ModelList(data=request.app.state.models)


@router.get("/{model:path}", responses=error_responses(404))
def retrieve_model(request: Request, _project_id: ProjectDep, model: str) -> ModelObject:
    """By its id or any name a request may use for it (the registry's)."""
    served_id = served_id_for(request.app.state.ctx.settings, model)
    for served in request.app.state.models:
        if served.id == served_id:
            return served
    raise NotFound(f"The model '{model}' does not exist", "model", code="model_not_found")

from __future__ import annotations

from fastapi import APIRouter, Request

from batchapi.api.deps import ProjectDep
from batchapi.api.schemas import ModelList, ModelObject, error_responses
from batchapi.errors import NotFound

router = APIRouter(prefix="/v1/models", tags=["models"], responses=error_responses(400, 401, 431))


@router.get("")
def list_models(request: Request, _project_id: ProjectDep) -> ModelList:
    return ModelList(data=[request.app.state.model])


@router.get("/{model:path}", responses=error_responses(404))
def retrieve_model(request: Request, _project_id: ProjectDep, model: str) -> ModelObject:
    served: ModelObject = request.app.state.model
    if model != served.id:
        raise NotFound(f"The model '{model}' does not exist", "model", code="model_not_found")
    return served

"""The OpenAPI document: FastAPI's, less the 422 it adds to every route with parameters, since this
API answers a request that fails validation with a 400 in the OpenAI error shape."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

DESCRIPTION = (
    "OpenAI-compatible Files and Batches API. Every error is `{\"error\": {message, type, param, code}}`; "
    "a method a path does not list is answered 405 with an `Allow` header naming those it does."
)


def install(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

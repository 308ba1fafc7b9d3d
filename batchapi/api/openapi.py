"""The OpenAPI document: FastAPI's, less the 422 it adds to every route with parameters, since this
API answers a request that fails validation with a 400 in the OpenAI error shape."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_ASSETS = "/docs/assets"

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
    install_docs(app)


def swagger_ui_dir() -> Path:
    """Swagger UI's files as the ``swagger-ui-py`` package ships them (found, not imported)."""
    spec = importlib.util.find_spec("swagger_ui")
    assert spec is not None and spec.origin, "swagger-ui-py is a dependency of batchapi"
    return Path(spec.origin).parent / "static"


def install_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI with every asset served from here, none from a CDN."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - API docs",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")

"""The app factory: nothing at import time, no GPU stack, the OpenAPI schema served."""

from __future__ import annotations

import subprocess
import sys

import httpx


def test_api_needs_no_torch_and_builds_nothing_at_import(tmp_path, tiny_llama_dir):
    code = f"""
import sys
import batchapi.api.main as main
from batchapi.config import load_settings
from batchapi.validation.scanner import Scanner  # validation is part of the API process
app = main.create_app(load_settings(data_dir={str(tmp_path)!r}, model={str(tiny_llama_dir)!r}))
heavy = sorted(m for m in ("torch", "transformers", "triton", "celery", "batchapi.workers", "batchapi.engine")
               if m in sys.modules)
assert heavy == [], heavy
assert not (__import__("pathlib").Path({str(tmp_path)!r}) / "batchapi.db").exists(), "connected at import"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_openapi_schema_lists_the_endpoints(pg_server):
    schema = httpx.get(pg_server.base_url + "/openapi.json").json()
    assert {"/v1/files", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}/cancel",
            "/v1/batches/{batch_id}/partial_results", "/v1/models", "/health"} <= set(schema["paths"])

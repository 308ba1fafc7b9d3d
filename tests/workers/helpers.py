"""Submitting batches over HTTP and reading back what they produced."""

from __future__ import annotations

import json
from collections import Counter

import httpx

from tests.utils.batch_service import jsonl, request_line


def lines_for(model: str, n: int, prefix: str = "req", max_tokens: int = 4, **body) -> list[dict]:
    return [
        request_line(f"{prefix}-{i}", model, f"Question {i}: what is {i} plus {i}?", max_tokens=max_tokens,
                     temperature=0, **body)
        for i in range(n)
    ]


def submit(http: httpx.Client, lines: list[dict]) -> str:
    uploaded = http.post("/v1/files", files={"file": ("batch.jsonl", jsonl(lines))}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    created = http.post("/v1/batches", json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h",
    })
    assert created.status_code == 200, created.text
    return created.json()["id"]


def file_lines(http: httpx.Client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    response = http.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def results(http: httpx.Client, batch: dict) -> tuple[list[dict], list[dict]]:
    return file_lines(http, batch["output_file_id"]), file_lines(http, batch["error_file_id"])


def assert_each_once(lines: list[dict], output: list[dict], errors: list[dict]) -> None:
    """Every input custom_id is in exactly one result line, and no other ids appear."""
    seen = Counter(r["custom_id"] for r in output + errors)
    expected = Counter(line["custom_id"] for line in lines)
    assert seen == expected, f"missing {set(expected) - set(seen)}, doubled {[k for k, v in seen.items() if v > 1]}"


def assert_usage_matches(batch: dict, output: list[dict]) -> None:
    usage = [r["response"]["body"]["usage"] for r in output]
    assert batch["usage"]["input_tokens"] == sum(u["prompt_tokens"] for u in usage)
    assert batch["usage"]["output_tokens"] == sum(u["completion_tokens"] for u in usage)
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == sum(
        u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usage
    )
    assert batch["request_counts"]["completed"] == len(output)

"""The lines of the output and error files, in the shapes of API.md."""

from __future__ import annotations

import json
import secrets

from batchapi.jobs.request_body import BodyError

# why requests that never ran (or were cut short) are in the error file
MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request finished.",
    "batch_expired": "The batch expired before this request finished.",
    "shard_failed": "The workers running this request failed too many times; it was not run.",
}


def _dump(record: dict) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def succeeded(custom_id: str, body: dict) -> bytes:
    return _dump({
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{secrets.token_hex(12)}", "body": body},
        "error": None,
    })


def rejected(custom_id: str, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """A request that ran (or was read) and was refused: a 400 with an OpenAI error body."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return _dump({
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": {"status_code": 400, "request_id": f"req_{secrets.token_hex(12)}", "body": {"error": error}},
        "error": None,
    })


def rejected_body(custom_id: str, exc: BodyError) -> bytes:
    return rejected(custom_id, exc.message, exc.param, exc.code)


def never_ran(custom_id: str, code: str) -> bytes:
    return _dump({
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": MESSAGES[code]},
    })

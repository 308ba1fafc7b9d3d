"""Output and error lines in the shapes of docs/API.md, with the codes of ``ErrorCode``."""

from __future__ import annotations

import json

import pytest

from batchapi.openai import render
from batchapi.openai.errors import ErrorCode, RequestError


def test_rejected_line_is_a_400_with_an_openai_error_body():
    record = json.loads(render.rejected("r1", RequestError("bad", "temperature", ErrorCode.INVALID_VALUE)))
    assert record["custom_id"] == "r1" and record["error"] is None
    assert record["id"].startswith("batch_req_") and record["response"]["request_id"].startswith("req_")
    assert record["response"]["status_code"] == 400
    assert record["response"]["body"] == {"error": {"message": "bad", "type": "invalid_request_error",
                                                    "param": "temperature", "code": "invalid_value"}}


@pytest.mark.parametrize("code", [ErrorCode.BATCH_CANCELLED, ErrorCode.BATCH_EXPIRED, ErrorCode.SHARD_FAILED])
def test_a_request_never_run_has_no_response(code):
    record = json.loads(render.never_ran("r2", code))
    assert record["response"] is None and record["error"]["code"] == code.value
    assert record["error"]["message"] == render.NOT_RUN_MESSAGES[code]


def test_lines_keep_unicode_and_end_in_one_newline():
    line = render.succeeded("ü-1", {"text": "naïve"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["response"]["body"] == {"text": "naïve"} and "ü-1".encode() in line


def test_a_lone_surrogate_is_written_back_as_its_escape_never_raising():
    line = render.never_ran("a\ud800", ErrorCode.SHARD_FAILED)
    assert line.isascii() and b'"custom_id":"a\\ud800"' in line
    assert json.loads(line)["custom_id"] == "a\ud800"
    record = json.loads(render.succeeded("r\udfff", {"text": "naïve \ud83d"}))
    assert (record["custom_id"], record["response"]["body"]["text"]) == ("r\udfff", "naïve \ud83d")

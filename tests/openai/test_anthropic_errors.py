"""Message Batch requests refused in Anthropic's words and shapes: ``tool_use`` / ``tool_result``
pairing, empty content and empty text blocks, unknown fields, each led by its field in dotted
form (``messages.0.content.1.text: ...``) in the batch's results."""

from __future__ import annotations

import json

import pytest

from batchapi.openai import render
from batchapi.openai.body import MESSAGES, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.message_results import result_line

TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


def result_message(messages: list, **params) -> str:
    """The message of the errored result a request of ``messages`` gets."""
    with pytest.raises(RequestError) as refused:
        parse_body(MESSAGES, {"model": "m", "max_tokens": 8, "messages": messages, **params})
    line = render.rejected("r", refused.value)
    result = json.loads(result_line(json.loads(line)))["result"]
    assert result["type"] == "errored" and result["error"]["error"]["type"] == "invalid_request_error"
    return result["error"]["error"]["message"]


EMPTY = "all messages must have non-empty content except for the optional final assistant message"


@pytest.mark.parametrize("messages,message", [
    ([{"role": "user", "content": []}], f"messages.0: {EMPTY}"),
    ([{"role": "user", "content": ""}], f"messages.0: {EMPTY}"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": []}, {"role": "user", "content": "b"}],
     f"messages.1: {EMPTY}"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}],
     "messages.0.content.1.text: text content blocks must be non-empty"),
    ([{"role": "user", "content": " \n"}], "messages.0.content.0.text: text content blocks must contain "
                                           "non-whitespace text"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [TOOL_USE]}, {"role": "user", "content": "b"}],
     "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1. Each "
     "`tool_use` block must have a corresponding `tool_result` block in the next message."),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [TOOL_USE]}],
     "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1. Each "
     "`tool_use` block must have a corresponding `tool_result` block in the next message."),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "r"}]}],
     "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9. Each `tool_result` "
     "block must have a corresponding `tool_use` block in the previous message."),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [TOOL_USE]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"},
                                   {"type": "tool_result", "tool_use_id": "toolu_1"}]}],
     "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: toolu_1. Each `tool_result` "
     "block must have a corresponding `tool_use` block in the previous message."),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [TOOL_USE, TOOL_USE]}],
     "messages.1.content.1.id: `tool_use` ids must be unique: toolu_1 is used twice"),
    ([{"role": "user", "content": "a", "name": "x"}], "messages.0.name: Extra inputs are not permitted"),
    ([{"role": "user"}], "messages.0.content: Field required"),
])
def test_refusals_read_as_anthropic_s(messages, message):
    assert result_message(messages) == message


def test_a_schema_error_names_its_path_once():
    schema = {"type": "object", "properties": {"a": {"type": "strin"}}}
    message = result_message([{"role": "user", "content": "a"}], tools=[{"name": "f", "input_schema": schema}])
    assert message == ("tools.0.input_schema.properties.a.type: unknown type 'strin'; expected one of ['string', "
                       "'number', 'integer', 'boolean', 'object', 'array', 'null']")
    assert "parameters" not in message


def test_answered_tool_uses_and_an_empty_final_assistant_turn_are_taken():
    parsed = parse_body(MESSAGES, {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                                     {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": ""}]})
    assert [m["role"] for m in parsed.messages] == ["user", "assistant", "tool", "user"]
    assert not parsed.continues_final_message  # nothing to continue: the reply starts afresh


def test_a_server_error_is_an_api_error_with_its_message_as_is():
    line = json.loads(render.rejected("r", RequestError("the engine failed", None, ErrorCode.SERVER_ERROR)))
    assert line["response"]["status_code"] == 500
    assert json.loads(result_line(line))["result"]["error"]["error"] == {"type": "api_error",
                                                                          "message": "the engine failed"}

"""Anthropic Messages bodies read into ParsedBody, Messages rendered, stored lines as Anthropic results."""

from __future__ import annotations

import json

import pytest

from batchapi.engine.request import CompletionOutput, GenerationResult
from batchapi.openai import render
from batchapi.openai.body import MESSAGES, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.message_results import message_body, result_line

TOOL = {"name": "lookup", "description": "Look it up.",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}


def body(**extra) -> dict:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **extra}


def refusal(value: dict) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_body(MESSAGES, value)
    return caught.value


def test_a_conversation_with_tools_reads_as_chat():
    parsed = parse_body(MESSAGES, body(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": "find x"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Sure."},
                                                    {"type": "tool_use", "id": "t1", "name": "lookup",
                                                     "input": {"q": "x"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                "content": [{"type": "text", "text": "42"}]},
                                               {"type": "text", "text": "thanks"}]}],
        tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        temperature=0.2, top_p=0.9, top_k=40, stop_sequences=["END"], metadata={"user_id": "u"}))
    assert parsed.endpoint == MESSAGES and parsed.max_tokens == 16
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": "Sure.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
        {"role": "user", "content": "thanks"},
    ]
    assert parsed.tools[0]["function"]["parameters"]["required"] == ["q"]
    assert (parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls) == ("required", None, False)
    assert (parsed.temperature, parsed.top_p, parsed.top_k, parsed.stop) == (0.2, 0.9, 40, ["END"])


def test_a_named_tool_is_a_forced_call():
    parsed = parse_body(MESSAGES, body(tools=[TOOL], tool_choice={"type": "tool", "name": "lookup"}))
    assert (parsed.tool_choice, parsed.tool_name) == ("required", "lookup")


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"max_tokens": None}, "max_tokens", ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"temperature": 1.5}, "temperature", ErrorCode.INVALID_VALUE),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", ErrorCode.INVALID_VALUE),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]",
     ErrorCode.INVALID_VALUE),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b "}]}, "messages[1].content",
     ErrorCode.INVALID_VALUE),
    ({"tools": [{**TOOL, "input_schema": {"type": "object", "if": {}}}]}, "tools[0].input_schema",
     ErrorCode.INVALID_JSON_SCHEMA),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name", ErrorCode.INVALID_VALUE),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", ErrorCode.INVALID_VALUE),
    ({"stream": True}, "stream", ErrorCode.INVALID_VALUE),
])
def test_bad_params_name_their_field(extra, param, code):
    error = refusal({k: v for k, v in body(**extra).items() if v is not None})
    assert (error.param, error.code) == (param, code)


def test_a_tool_result_must_answer_the_turn_before():
    error = refusal(body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9",
                                                                  "content": "x"}]}]))
    assert error.param == "messages[0].content[0]"
    assert error.message.startswith("unexpected `tool_use_id` found in `tool_result` blocks: t9.")


class Tokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def result(text: str, finish: str, token_text: str | None = None) -> GenerationResult:
    ids = [ord(c) for c in (token_text if token_text is not None else text)]
    return GenerationResult("r", prompt_tokens=10, cached_tokens=4, outputs=[CompletionOutput(0, text, ids, finish)])


@pytest.mark.parametrize(("text", "finish", "tokens", "reason", "sequence"), [
    ("hello", "stop", None, "end_turn", None),
    ("hello", "length", None, "max_tokens", None),
    ("hello", "stop", "helloEND", "stop_sequence", "END"),
])
def test_a_message_names_why_it_stopped(text, finish, tokens, reason, sequence):
    parsed = parse_body(MESSAGES, body(stop_sequences=["END"]))
    message = message_body(parsed, result(text, finish, tokens), "m", Tokenizer())
    assert message["content"] == [{"type": "text", "text": "hello"}]
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)
    assert message["usage"] == {"input_tokens": 6, "output_tokens": len(tokens or text),
                                "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}


def test_a_forced_call_is_a_tool_use_block():
    parsed = parse_body(MESSAGES, body(tools=[TOOL], tool_choice={"type": "tool", "name": "lookup"}))
    message = message_body(parsed, result('{"name":"lookup","arguments":{"q":"x"}}', "stop"), "m", Tokenizer())
    assert message["stop_reason"] == "tool_use"
    [block] = message["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "lookup", {"q": "x"})


def translated(line: bytes) -> dict:
    return json.loads(result_line(json.loads(line)))


def test_stored_lines_become_anthropic_results():
    assert translated(render.succeeded("a", {"type": "message"})) == {
        "custom_id": "a", "result": {"type": "succeeded", "message": {"type": "message"}}}
    refused = translated(render.rejected("b", RequestError("bad temperature", "temperature")))
    assert refused == {"custom_id": "b", "result": {"type": "errored", "error": {
        "type": "error", "error": {"type": "invalid_request_error", "message": "temperature: bad temperature"}}}}
    server = translated(render.rejected("c", RequestError("boom", None, ErrorCode.SERVER_ERROR)))
    assert server["result"]["error"]["error"]["type"] == "api_error"
    assert translated(render.never_ran("d", ErrorCode.BATCH_CANCELLED))["result"] == {"type": "canceled"}
    assert translated(render.never_ran("e", ErrorCode.BATCH_EXPIRED))["result"] == {"type": "expired"}
    assert translated(render.never_ran("f", ErrorCode.SHARD_FAILED))["result"]["error"]["error"]["type"] == "api_error"


def test_an_error_code_this_version_does_not_know_is_an_api_error_not_a_broken_stream():
    line = json.dumps({"id": "x", "custom_id": "g", "response": None,
                       "error": {"code": "a_code_from_another_version", "message": "gone"}}).encode()
    assert translated(line) == {"custom_id": "g", "result": {"type": "errored", "error": {
        "type": "error", "error": {"type": "api_error", "message": "gone"}}}}

"""Responses API bodies read into chat's ParsedBody, and results rendered as Response objects
that the openai SDK's type parses (no model)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from openai.types.responses import Response

from batchapi.openai.body import CHAT, RESPONSES, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import parse_line
from batchapi.openai.responses import response_body
from batchapi.openai.tools import template_input

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                 "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "name": "get_time", "parameters": None, "strict": None}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}
CALL = json.dumps({"city": "Paris"})


def responses(**fields):
    return parse_body(RESPONSES, {"model": "m", "input": "Weather in Paris?", **fields})


def refusal(**fields) -> RequestError:
    body = {"model": "m", "input": "x", **fields}
    with pytest.raises(RequestError) as caught:
        parse_body(RESPONSES, body)
    return caught.value


def where(error: RequestError) -> tuple[ErrorCode, str]:
    return error.code, error.param


# -- the request

def test_a_string_input_is_one_user_message_and_instructions_a_system_message_first():
    parsed = responses(instructions="Be brief.", max_output_tokens=50, temperature=0.2, top_p=0.9)
    assert parsed.endpoint == RESPONSES and parsed.prompt is None
    assert parsed.messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Weather in Paris?"}]
    assert (parsed.max_tokens, parsed.temperature, parsed.top_p, parsed.n) == (50, 0.2, 0.9, 1)
    assert (parsed.response_format, parsed.tools, parsed.tool_choice) == ("text", None, "none")
    assert responses().max_tokens is None  # up to the model's context, as chat without max_tokens


def test_message_items_with_text_parts_read_as_chat_messages():
    parsed = parse_body(RESPONSES, {"model": "m", "input": [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello, "},
                                                         {"type": "input_text", "text": "there."}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Bonjour.", "annotations": []}]},
        {"role": "user", "content": "And now?"},
    ]})
    assert parsed.messages == [{"role": "system", "content": "Answer in French."},
                               {"role": "user", "content": "Hello, there."},
                               {"role": "assistant", "content": "Bonjour."},
                               {"role": "user", "content": "And now?"}]


def test_function_calls_and_outputs_become_chat_tool_turns_and_the_same_prompt():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": CALL},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "get_weather",
         "arguments": json.dumps({"city": "Rome"}), "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25 C"}]},
    ]
    parsed = parse_body(RESPONSES, {"model": "m", "input": items, "tools": [WEATHER]})
    chat = parse_body(CHAT, {"model": "m", "tools": [CHAT_WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Rome"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
    ]})
    assert parsed.messages == chat.messages
    assert (parsed.tools, parsed.tool_choice) == (chat.tools, chat.tool_choice)
    for template in (None, "{{ tools }}"):  # the fallback, and a template that reads tools
        assert template_input(parsed, template) == template_input(chat, template)


def test_a_call_joins_the_assistant_message_just_before_it():
    parsed = parse_body(RESPONSES, {"model": "m", "input": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": CALL},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": CALL},
        {"type": "function_call_output", "call_id": "c2", "output": "still sunny"},
    ]})
    assert [(m["role"], m["content"], [c["id"] for c in m.get("tool_calls", [])]) for m in parsed.messages] == [
        ("user", "Weather?", []), ("assistant", "Let me look.", ["c1"]), ("tool", "sunny", []),
        ("assistant", "", ["c2"]), ("tool", "still sunny", [])]
    assert parsed.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}


def call(call_id="c1", **fields):
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": CALL, **fields}


def output(call_id="c1", **fields):
    return {"type": "function_call_output", "call_id": call_id, "output": "ok", **fields}


USER = {"role": "user", "content": "hi"}
BAD_INPUTS = {
    "not a list": (5, ErrorCode.INVALID_TYPE, "input"),
    "empty": ([], ErrorCode.INVALID_VALUE, "input"),
    "an item not an object": ([USER, "hi"], ErrorCode.INVALID_TYPE, "input[1]"),
    "a role chat has but Responses not": ([{"role": "tool", "content": "x"}], ErrorCode.INVALID_VALUE,
                                          "input[0].role"),
    "no content": ([{"role": "user"}], ErrorCode.MISSING_REQUIRED_PARAMETER, "input[0].content"),
    "an image part": ([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}],
                      ErrorCode.INVALID_VALUE, "input[0].content[0]"),
    "a message field": ([{"role": "user", "content": "x", "name": "bob"}], ErrorCode.UNKNOWN_PARAMETER,
                        "input[0].name"),
    "a reasoning item": ([USER, {"type": "reasoning", "summary": []}], ErrorCode.INVALID_VALUE, "input[1].type"),
    "an item reference": ([{"type": "item_reference", "id": "msg_1"}], ErrorCode.INVALID_VALUE, "input[0].type"),
    "a built-in tool call": ([USER, {"type": "web_search_call", "id": "ws_1"}], ErrorCode.INVALID_VALUE,
                             "input[1].type"),
    "an output with no call": ([USER, output()], ErrorCode.INVALID_VALUE, "input[1].call_id"),
    "a call with no output": ([USER, call()], ErrorCode.INVALID_VALUE, "input"),
    "a message before the output": ([USER, call(), USER, output()], ErrorCode.INVALID_VALUE, "input[2]"),
    "a call before the last is answered": ([USER, call("a"), call("b"), output("a"), call("c"), output("b")],
                                           ErrorCode.INVALID_VALUE, "input[4]"),
    "an output given twice": ([USER, call(), output(), output()], ErrorCode.INVALID_VALUE, "input[3].call_id"),
    "a call id twice": ([USER, call(), call(), output()], ErrorCode.INVALID_VALUE, "input[2].call_id"),
    "no call id": ([USER, {"type": "function_call", "name": "f", "arguments": "{}"}],
                   ErrorCode.MISSING_REQUIRED_PARAMETER, "input[1].call_id"),
    "arguments not JSON": ([USER, call(arguments="{oops"), output()], ErrorCode.INVALID_VALUE, "input[1].arguments"),
    "arguments not a string": ([USER, call(arguments={"city": "Paris"}), output()], ErrorCode.INVALID_TYPE,
                               "input[1].arguments"),
    "a bad function name": ([USER, call(name="get weather"), output()], ErrorCode.INVALID_VALUE, "input[1].name"),
    "no output": ([USER, call(), {"type": "function_call_output", "call_id": "c1"}],
                  ErrorCode.MISSING_REQUIRED_PARAMETER, "input[2].output"),
}


@pytest.mark.parametrize("value,code,param", BAD_INPUTS.values(), ids=list(BAD_INPUTS))
def test_a_bad_input_is_refused_naming_its_item(value, code, param):
    assert where(refusal(input=value)) == (code, param)


def test_input_is_required():
    with pytest.raises(RequestError) as caught:
        parse_body(RESPONSES, {"model": "m"})
    assert where(caught.value) == (ErrorCode.MISSING_REQUIRED_PARAMETER, "input")


@pytest.mark.parametrize("kind", ["text", "json_object"])
def test_text_and_json_object_formats(kind):
    parsed = responses(text={"format": {"type": kind}})
    assert (parsed.response_format, parsed.json_schema) == (kind, None)


def test_a_json_schema_format_holds_its_fields_in_the_format_itself():
    parsed = responses(text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True,
                                        "description": "A person."}})
    chat = parse_body(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}})
    assert (parsed.response_format, parsed.json_schema, parsed.json_schema_name, parsed.json_schema_strict) == (
        chat.response_format, chat.json_schema, chat.json_schema_name, chat.json_schema_strict)


BAD_FORMATS = {
    "chat's nesting": ({"format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
                       ErrorCode.UNKNOWN_PARAMETER, "text.format.json_schema"),
    "no name": ({"format": {"type": "json_schema", "schema": PERSON}}, ErrorCode.MISSING_REQUIRED_PARAMETER,
                "text.format.name"),
    "no schema": ({"format": {"type": "json_schema", "name": "p"}}, ErrorCode.MISSING_REQUIRED_PARAMETER,
                  "text.format.schema"),
    "an unknown type": ({"format": {"type": "yaml"}}, ErrorCode.INVALID_VALUE, "text.format.type"),
    "a format not an object": ({"format": "json_object"}, ErrorCode.INVALID_TYPE, "text.format"),
    "strict not a boolean": ({"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": "yes"}},
                             ErrorCode.INVALID_TYPE, "text.format.strict"),
    "an unknown verbosity": ({"verbosity": "loud"}, ErrorCode.INVALID_VALUE, "text.verbosity"),
    "an unknown text field": ({"format": {"type": "text"}, "color": "red"}, ErrorCode.UNKNOWN_PARAMETER, "text.color"),
}


@pytest.mark.parametrize("text,code,param", BAD_FORMATS.values(), ids=list(BAD_FORMATS))
def test_a_bad_text_format_is_refused(text, code, param):
    assert where(refusal(text=text)) == (code, param)


def test_an_unsupported_schema_keyword_is_named_with_its_text_format_path():
    schema = {"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 2}}}
    error = refusal(text={"format": {"type": "json_schema", "name": "p", "schema": schema}})
    assert where(error) == (ErrorCode.INVALID_JSON_SCHEMA, "text.format.schema.properties.age")
    assert "'multipleOf'" in error.message
    strict = refusal(text={"format": {"type": "json_schema", "name": "p", "strict": True,
                                      "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}})
    assert strict.code == ErrorCode.INVALID_JSON_SCHEMA and strict.param.startswith("text.format.schema")


def test_flat_function_tools_read_as_chat_tools():
    parsed = responses(tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_time"},
                       parallel_tool_calls=False)
    chat = parse_body(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                             "tools": [CHAT_WEATHER, {"type": "function", "function": {"name": "get_time"}}]})
    assert parsed.tools == chat.tools
    assert (parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls) == ("required", "get_time", False)
    assert (responses(tools=[WEATHER]).tool_choice, responses(tools=[WEATHER], tool_choice="none").tool_choice) == (
        "auto", "none")


def test_without_tools_auto_and_parallel_tool_calls_are_accepted_and_empty_tools_are_none():
    parsed = responses(tools=[], tool_choice="auto", parallel_tool_calls=True)
    assert (parsed.tools, parsed.tool_choice, parsed.tool_name) == (None, "none", None)


@pytest.mark.parametrize("tool", [
    {"type": "web_search"}, {"type": "web_search_preview", "search_context_size": "low"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]}, {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "browser"},
    {"type": "image_generation"}, {"type": "mcp", "server_label": "x", "server_url": "https://x"},
])
def test_a_built_in_tool_is_refused_by_its_type(tool):
    error = refusal(tools=[WEATHER, tool])
    assert where(error) == (ErrorCode.INVALID_VALUE, "tools[1].type")
    assert repr(tool["type"]) in error.message and "only 'function' tools" in error.message


BAD_TOOLS = {
    "chat's nesting": ({"tools": [CHAT_WEATHER]}, ErrorCode.UNKNOWN_PARAMETER, "tools[0].function"),
    "no name": ({"tools": [{"type": "function", "parameters": WEATHER_PARAMETERS}]},
                ErrorCode.MISSING_REQUIRED_PARAMETER, "tools[0].name"),
    "a name twice": ({"tools": [WEATHER, WEATHER]}, ErrorCode.INVALID_VALUE, "tools[1].name"),
    "parameters not an object schema": ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]},
                                        ErrorCode.INVALID_JSON_SCHEMA, "tools[0].parameters"),
    "chat's named choice": ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                 "function": {"name": "get_weather"}}},
                            ErrorCode.UNKNOWN_PARAMETER, "tool_choice.function"),
    "a choice of no tool": ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
                            ErrorCode.INVALID_VALUE, "tool_choice.name"),
    "a built-in choice": ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}},
                          ErrorCode.INVALID_VALUE, "tool_choice.type"),
    "allowed tools": ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
                      ErrorCode.INVALID_VALUE, "tool_choice.type"),
    "required without tools": ({"tool_choice": "required"}, ErrorCode.INVALID_VALUE, "tool_choice"),
    "a choice name missing": ({"tools": [WEATHER], "tool_choice": {"type": "function"}},
                              ErrorCode.MISSING_REQUIRED_PARAMETER, "tool_choice.name"),
}


@pytest.mark.parametrize("fields,code,param", BAD_TOOLS.values(), ids=list(BAD_TOOLS))
def test_bad_tools_are_refused(fields, code, param):
    assert where(refusal(**fields)) == (code, param)


@pytest.mark.parametrize("name,value", [
    ("previous_response_id", "resp_123"), ("conversation", "conv_123"), ("background", True),
    ("include", ["message.output_text.logprobs"]),
    ("prompt", {"id": "pmpt_123"}), ("truncation", "auto"), ("top_logprobs", 3), ("stream", True),
])
def test_fields_a_batch_cannot_honour_are_refused_by_name(name, value):
    error = refusal(**{name: value})
    assert where(error) == (ErrorCode.INVALID_VALUE, name)
    assert f"'{name}' is not supported" in error.message


def test_the_harmless_values_of_refused_fields_and_the_ignored_fields_are_accepted():
    parsed = responses(background=False, include=[], truncation="disabled", top_logprobs=0, stream=False,
                       previous_response_id=None, reasoning=None, store=True, metadata={"run": "7"}, user="u-1",
                       service_tier="auto", prompt_cache_key="k", safety_identifier="s", max_tool_calls=3)
    assert parsed.messages == [{"role": "user", "content": "Weather in Paris?"}]
    assert where(refusal(background=0)) == (ErrorCode.INVALID_VALUE, "background")  # not False


@pytest.mark.parametrize("name", ["seed", "n", "stop", "max_tokens", "messages", "response_format", "logprobs",
                                  "top_k", "frobnicate"])
def test_fields_the_responses_api_does_not_have_are_unknown(name):
    assert where(refusal(**{name: 1})) == (ErrorCode.UNKNOWN_PARAMETER, name)


@pytest.mark.parametrize("fields,code,param", [
    ({"instructions": ["be brief"]}, ErrorCode.INVALID_TYPE, "instructions"),
    ({"metadata": {"n": 1}}, ErrorCode.INVALID_TYPE, "metadata"),
    ({"store": "yes"}, ErrorCode.INVALID_TYPE, "store"),
    ({"user": 7}, ErrorCode.INVALID_TYPE, "user"),
    ({"max_output_tokens": 0}, ErrorCode.INVALID_VALUE, "max_output_tokens"),
    ({"temperature": 3}, ErrorCode.INVALID_VALUE, "temperature"),
    ({"model": ""}, ErrorCode.MISSING_REQUIRED_PARAMETER, "model"),
])
def test_bad_values_of_accepted_fields(fields, code, param):
    assert where(refusal(**fields)) == (code, param)


def test_a_responses_line_parses_and_its_errors_name_the_body_field():
    good = {"custom_id": "a", "method": "POST", "url": RESPONSES, "body": {"model": "m", "input": "hi"}}
    assert parse_line(json.dumps(good).encode(), 1, None).body.endpoint == RESPONSES
    assert parse_line(json.dumps(good).encode(), 1, RESPONSES).error is None
    bad = {**good, "body": {"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}}
    line = parse_line(json.dumps(bad).encode(), 1, RESPONSES)
    assert (line.custom_id, line.error.line_param, line.error.in_body) == ("a", "body.tools[0].type", True)
    assert parse_line(json.dumps(good).encode(), 1, CHAT).error.code == ErrorCode.INVALID_URL


# -- the result

def result(text: str, finish_reason: str = "stop"):
    out = SimpleNamespace(index=0, text=text, token_ids=[1, 2, 3], finish_reason=finish_reason, logprobs=None)
    return SimpleNamespace(request_id="engine-7", prompt_tokens=11, cached_tokens=4, error=None, outputs=[out],
                           completion_tokens=3)


def test_a_text_answer_is_one_completed_message_with_responses_usage():
    parsed = responses(instructions="Be brief.", max_output_tokens=30, metadata={"run": "7"}, user="u-1",
                       store=True, temperature=0.5)
    body = response_body(parsed, result("Sunny."), "smollm2")
    response = Response.model_validate(body)
    assert re.fullmatch(r"resp_[0-9a-f]{48}", body["id"]) and "engine-7" not in body["id"]
    assert (response.object, response.status, response.model, response.output_text) == (
        "response", "completed", "smollm2", "Sunny.")
    [message] = body["output"]
    assert re.fullmatch(r"msg_[0-9a-f]{48}", message.pop("id"))
    assert message == {"type": "message", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": "Sunny.", "annotations": [], "logprobs": []}]}
    assert body["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    assert (body["error"], body["incomplete_details"], body["previous_response_id"]) == (None, None, None)
    assert (body["instructions"], body["max_output_tokens"], body["metadata"], body["user"], body["store"]) == (
        "Be brief.", 30, {"run": "7"}, "u-1", False)
    assert (body["temperature"], body["top_p"], body["tools"], body["tool_choice"], body["text"]) == (
        0.5, 1.0, [], "auto", {"format": {"type": "text"}, "verbosity": "medium"})
    assert body["created_at"] == body["completed_at"]


def test_an_output_cut_by_its_limit_is_an_incomplete_response():
    parsed = responses(tools=[WEATHER], tool_choice="required")
    body = response_body(parsed, result('{"name": "get_weather", "argu', finish_reason="length"), "m")
    response = Response.model_validate(body)
    assert (response.status, response.incomplete_details.reason, response.completed_at) == (
        "incomplete", "max_output_tokens", None)
    [message] = body["output"]
    assert message["type"] == "message" and message["status"] == "incomplete"  # a cut call stays text


def test_calls_become_function_call_items_and_the_request_is_repeated():
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    parsed = responses(tools=[WEATHER, TIME], tool_choice="required", text={"format": fmt})
    text = json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}},
                       {"name": "get_time", "arguments": {}}])
    body = response_body(parsed, result(text), "m")
    response = Response.model_validate(body)
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    first, second = body["output"]
    assert re.fullmatch(r"fc_[0-9a-f]{48}", first["id"]) and re.fullmatch(r"call_[0-9a-f]{24}", first["call_id"])
    assert first["call_id"] != second["call_id"]
    assert {k: first[k] for k in ("name", "arguments", "status")} == {
        "name": "get_weather", "arguments": '{"city":"Paris"}', "status": "completed"}
    assert (second["name"], json.loads(second["arguments"])) == ("get_time", {})
    assert (body["tools"], body["tool_choice"], body["text"]["format"]) == ([WEATHER, TIME], "required", fmt)
    assert response.text.format.type == "json_schema" and response.tools[0].name == "get_weather"


def test_a_named_choice_and_auto_calls_render_as_function_calls():
    named = responses(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    body = response_body(named, result('{"name": "get_weather", "arguments": {"city": "Oslo"}}'), "m")
    Response.model_validate(body)
    assert [item["name"] for item in body["output"]] == ["get_weather"]
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"}
    auto = responses(tools=[WEATHER])
    tagged = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert [item["type"] for item in response_body(auto, result(tagged), "m")["output"]] == ["function_call"]
    plain = response_body(auto, result("I cannot tell."), "m")
    assert Response.model_validate(plain).output_text == "I cannot tell."

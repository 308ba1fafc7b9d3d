"""Chat bodies with response formats, tools and tool turns, in OpenAI's shapes."""

from __future__ import annotations

import pytest

from batchapi.openai.body import CHAT, COMPLETIONS, parse_body
from batchapi.openai.errors import ErrorCode, RequestError

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}


def chat(**fields):
    return parse_body(CHAT, {"model": "m", "messages": USER, **fields})


def refusal(endpoint=CHAT, **fields) -> RequestError:
    body = {"model": "m", **({"messages": USER} if endpoint == CHAT else {"prompt": "x"}), **fields}
    with pytest.raises(RequestError) as caught:
        parse_body(endpoint, body)
    return caught.value


def test_a_plain_chat_body_has_no_format_and_no_tools():
    parsed = chat()
    assert (parsed.response_format, parsed.json_schema, parsed.tools, parsed.tool_choice, parsed.tool_name,
            parsed.parallel_tool_calls) == ("text", None, None, "none", None, True)


@pytest.mark.parametrize("kind", ["text", "json_object"])
def test_text_and_json_object_formats(kind):
    parsed = chat(response_format={"type": kind})
    assert (parsed.response_format, parsed.json_schema) == (kind, None)


def test_a_json_schema_format_keeps_schema_name_and_strict():
    parsed = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "person-1", "description": "a person", "schema": PERSON, "strict": True}})
    assert (parsed.response_format, parsed.json_schema, parsed.json_schema_name, parsed.json_schema_strict) == (
        "json_schema", PERSON, "person-1", True)
    loose = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "array"},
                                                                          "strict": None}})
    assert (loose.json_schema, loose.json_schema_strict) == ({"type": "array"}, False)


@pytest.mark.parametrize(("response_format", "param", "code"), [
    ("json", "response_format", ErrorCode.INVALID_TYPE),
    ({"type": "xml"}, "response_format.type", ErrorCode.INVALID_VALUE),
    ({"type": "json_object", "schema": {}}, "response_format.schema", ErrorCode.UNKNOWN_PARAMETER),
    ({"type": "json_schema"}, "response_format.json_schema", ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name",
     ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}, "response_format.json_schema.name",
     ErrorCode.INVALID_VALUE),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": PERSON}},
     "response_format.json_schema.name", ErrorCode.INVALID_VALUE),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema",
     ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": "{}"}}, "response_format.json_schema.schema",
     ErrorCode.INVALID_TYPE),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
     "response_format.json_schema.strict", ErrorCode.INVALID_TYPE),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "format": 1}},
     "response_format.json_schema.format", ErrorCode.UNKNOWN_PARAMETER),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"properties": {"age": {"if": {}}}}}},
     "response_format.json_schema.schema.properties.age", ErrorCode.INVALID_JSON_SCHEMA),
    ({"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                             "schema": {**PERSON, "additionalProperties": True}}},
     "response_format.json_schema.schema", ErrorCode.INVALID_JSON_SCHEMA),
])
def test_bad_response_formats_name_their_field(response_format, param, code):
    error = refusal(response_format=response_format)
    assert (error.param, error.code) == (param, code)


def test_unsupported_keywords_are_named_in_the_message():
    error = refusal(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"age": {"type": "integer", "if": {}}}}}})
    assert error.message == "response_format.json_schema.schema.properties.age: the keyword 'if' is not supported"


def test_tools_are_kept_as_a_template_takes_them_with_default_parameters():
    parsed = chat(tools=[WEATHER, TIME])
    assert parsed.tools == [WEATHER, {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    assert (parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls) == ("auto", None, True)


def test_parameters_without_a_type_are_an_object():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {}}}}}
    assert chat(tools=[tool]).tools[0]["function"]["parameters"] == {"type": "object", "properties": {"a": {}}}


@pytest.mark.parametrize(("choice", "expected"), [
    ("none", ("none", None)), ("auto", ("auto", None)), ("required", ("required", None)),
    ({"type": "function", "function": {"name": "get_time"}}, ("required", "get_time")),
])
def test_tool_choices(choice, expected):
    parsed = chat(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
    assert (parsed.tool_choice, parsed.tool_name, parsed.parallel_tool_calls) == (*expected, False)


def tool_with(**function):
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"tools": {}}, "tools", ErrorCode.INVALID_TYPE),
    ({"tools": []}, "tools", ErrorCode.INVALID_VALUE),
    ({"tools": [TIME] * 129}, "tools", ErrorCode.INVALID_VALUE),
    ({"tools": ["get_time"]}, "tools[0]", ErrorCode.INVALID_TYPE),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", ErrorCode.INVALID_VALUE),
    ({"tools": [{"type": "function"}]}, "tools[0].function", ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x", ErrorCode.UNKNOWN_PARAMETER),
    ({"tools": [TIME, {"type": "function", "function": {}}]}, "tools[1].function.name",
     ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"tools": [tool_with(name="get weather")]}, "tools[0].function.name", ErrorCode.INVALID_VALUE),
    ({"tools": [tool_with(name="f" * 65)]}, "tools[0].function.name", ErrorCode.INVALID_VALUE),
    ({"tools": [tool_with(returns={})]}, "tools[0].function.returns", ErrorCode.UNKNOWN_PARAMETER),
    ({"tools": [tool_with(description=3)]}, "tools[0].function.description", ErrorCode.INVALID_TYPE),
    ({"tools": [tool_with(strict=1)]}, "tools[0].function.strict", ErrorCode.INVALID_TYPE),
    ({"tools": [tool_with(parameters=[])]}, "tools[0].function.parameters", ErrorCode.INVALID_TYPE),
    ({"tools": [tool_with(parameters={"type": "string"})]}, "tools[0].function.parameters",
     ErrorCode.INVALID_JSON_SCHEMA),
    ({"tools": [tool_with(parameters={"properties": {"a": {"oneOf": []}}})]},
     "tools[0].function.parameters.properties.a", ErrorCode.INVALID_JSON_SCHEMA),
    ({"tools": [tool_with(strict=True, parameters=WEATHER["function"]["parameters"])]},
     "tools[0].function.parameters", ErrorCode.INVALID_JSON_SCHEMA),
    ({"tools": [TIME, TIME]}, "tools[1].function.name", ErrorCode.INVALID_VALUE),
    ({"tool_choice": "auto"}, "tool_choice", ErrorCode.INVALID_VALUE),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", ErrorCode.INVALID_VALUE),
    ({"tools": [TIME], "tool_choice": "any"}, "tool_choice", ErrorCode.INVALID_VALUE),
    ({"tools": [TIME], "tool_choice": 1}, "tool_choice", ErrorCode.INVALID_TYPE),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice.function.name", ErrorCode.INVALID_VALUE),
    ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice.function.name",
     ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"tools": [TIME], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice.allowed_tools",
     ErrorCode.UNKNOWN_PARAMETER),
    ({"tools": [TIME], "parallel_tool_calls": "no"}, "parallel_tool_calls", ErrorCode.INVALID_TYPE),
])
def test_bad_tool_fields_name_their_field(fields, param, code):
    error = refusal(**fields)
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("name", ["response_format", "tools", "tool_choice", "parallel_tool_calls"])
def test_completions_take_none_of_the_chat_only_fields(name):
    error = refusal(COMPLETIONS, **{name: {"type": "text"}})
    assert (error.param, error.code) == (name, ErrorCode.UNKNOWN_PARAMETER)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "developer", "content": "Be brief.", "name": "ops"},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        CALL, {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sunny"}]},
    {"role": "assistant", "content": "Sunny, and it is noon."},
]


def test_tool_turns_parse_into_what_a_chat_template_takes():
    parsed = chat(messages=CONVERSATION)
    assert parsed.messages == [
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny, and it is noon."},
    ]


def test_an_assistant_message_may_hold_text_and_calls_or_no_content_key():
    messages = [*USER, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    assert chat(messages=messages).messages[1]["content"] == "Checking."
    messages[1] = {"role": "assistant", "tool_calls": [CALL]}
    assert chat(messages=messages).messages[1]["content"] == ""


def with_messages(*messages):
    return refusal(messages=[*USER, *messages])


@pytest.mark.parametrize(("messages", "param", "code", "words"), [
    ([{"role": "assistant", "content": None}], "messages[1].content", ErrorCode.MISSING_REQUIRED_PARAMETER, "required"),
    ([{"role": "assistant", "content": None, "tool_calls": []}], "messages[1].content",
     ErrorCode.MISSING_REQUIRED_PARAMETER, "required"),
    ([{"role": "user", "content": None, "tool_calls": [CALL]}], "messages[1].content",
     ErrorCode.MISSING_REQUIRED_PARAMETER, "required"),
    ([{"role": "assistant", "tool_calls": {"id": "x"}}], "messages[1].tool_calls", ErrorCode.INVALID_TYPE, "array"),
    ([{"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[1].tool_calls[0]", ErrorCode.INVALID_VALUE, "'type': 'function'"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"a": 1}}}]}],
     "messages[1].tool_calls[0].function.arguments", ErrorCode.INVALID_TYPE, "a string holding a JSON object"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": "{city"}}]}],
     "messages[1].tool_calls[0].function.arguments", ErrorCode.INVALID_VALUE, "a string holding a JSON object"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": "[1]"}}]}],
     "messages[1].tool_calls[0].function.arguments", ErrorCode.INVALID_VALUE, "a string holding a JSON object"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "a b", "arguments": "{}"}}]}],
     "messages[1].tool_calls[0].function.name", ErrorCode.INVALID_VALUE, "function name"),
    ([{"role": "tool", "content": "Sunny"}], "messages[1].tool_call_id", ErrorCode.MISSING_REQUIRED_PARAMETER,
     "required"),
    ([{"role": "tool", "content": "Sunny", "tool_call_id": 1}], "messages[1].tool_call_id", ErrorCode.INVALID_TYPE,
     "string"),
    ([{"role": "tool", "content": "Sunny", "tool_call_id": "call_1"}], "messages[1].tool_call_id",
     ErrorCode.INVALID_VALUE, "must answer a call"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "Sunny", "tool_call_id": "call_9"}],
     "messages[2].tool_call_id", ErrorCode.INVALID_VALUE, "'call_9' is not one awaiting an answer"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "and?"}], "messages[2]",
     ErrorCode.INVALID_VALUE, "'call_1' has no 'tool' message"),
    ([{"role": "assistant", "tool_calls": [CALL]}], "messages", ErrorCode.INVALID_VALUE, "'call_1' has no 'tool'"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "a", "tool_call_id": "call_1"},
      {"role": "tool", "content": "b", "tool_call_id": "call_1"}], "messages[3].tool_call_id", ErrorCode.INVALID_VALUE,
     "not one awaiting"),
    ([{"role": "assistant", "tool_calls": [CALL, CALL]}], "messages[1].tool_calls[1].id", ErrorCode.INVALID_VALUE,
     "used twice"),
    ([{"role": "user", "content": "hi", "name": ""}], "messages[1].name", ErrorCode.INVALID_TYPE, "non-empty"),
])
def test_bad_tool_turns_name_their_field(messages, param, code, words):
    error = with_messages(*messages)
    assert (error.param, error.code) == (param, code) and words in error.message

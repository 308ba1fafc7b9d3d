"""Tools in the prompt, the schema a forced call follows, and the calls read back from an output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchapi.openai.body import CHAT, parse_body
from batchapi.openai.schema import check_schema
from batchapi.openai.tools import (
    call_schema,
    chat_messages,
    fallback_messages,
    knows_tools,
    output_constraint,
    parse_tool_calls,
)

# the default model's template (SmolLM2-135M-Instruct): it knows no tools and adds message['content'] as a string
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
TREE = {"type": "function", "function": {"name": "plant", "parameters": {
    "type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}}, "required": ["root"],
    "$defs": {"Node": {"type": "object", "properties": {"name": {"type": "string"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/Node"}}}, "required": ["name"], "additionalProperties": False}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        CALL, {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "Sunny at noon."},
    {"role": "user", "content": "Thanks"},
]


def chat(messages=None, **fields):
    return parse_body(CHAT, {"model": "m", "messages": messages or CONVERSATION[:1], **fields})


def render(messages) -> str:
    template = ImmutableSandboxedEnvironment().from_string(SMOLLM2)
    return template.render(messages=messages, add_generation_prompt=True)


def test_only_a_template_that_reads_tools_knows_them():
    assert not knows_tools(SMOLLM2) and not knows_tools(None)
    assert knows_tools("{% if tools %}{{ tools | tojson }}{% endif %}")


def test_chat_messages_are_the_parsed_ones_with_arguments_as_objects():
    parsed = chat(CONVERSATION, tools=[WEATHER, TIME])
    messages = chat_messages(parsed)
    assert messages == parsed.messages and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_fallback_puts_the_tools_in_a_new_system_message_and_renders_in_smollm2():
    parsed = chat(CONVERSATION, tools=[WEATHER, TIME])
    messages = fallback_messages(parsed)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert all(isinstance(m["content"], str) and set(m) == {"role", "content"} for m in messages)
    system = messages[0]["content"]
    listing = re.search(r"<tools>\n(.*)\n</tools>", system, re.DOTALL).group(1).splitlines()
    assert [json.loads(line) for line in listing] == parsed.tools
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\nSunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    prompt = render(messages)
    assert prompt.startswith("<|im_start|>system\nYou are provided with function signatures") and "SmolLM" not in prompt
    assert prompt.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_appends_the_tools_to_a_system_message_and_keeps_text_before_calls():
    messages = [{"role": "system", "content": "Be brief."}, CONVERSATION[0],
                {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    out = fallback_messages(chat(messages, tools=[WEATHER]))
    assert out[0]["content"].startswith("Be brief.\n\nYou are provided with function signatures")
    assert out[2]["content"].startswith("Let me check.\n<tool_call>\n")
    render(out)


def test_fallback_without_tools_still_writes_past_calls_as_text():
    out = fallback_messages(chat(CONVERSATION))
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant", "user"]
    assert "<tool_call>" in out[1]["content"] and "You are provided" not in render(out)
    assert out[0] == {"role": "user", "content": "Weather in Paris and the time?"}


@pytest.mark.parametrize(("fields", "words"), [
    ({"tool_choice": "none"}, "Do not call any of these functions"),
    ({"tool_choice": "required"}, "Reply with only a JSON array of calls"),
    ({"tool_choice": "required", "parallel_tool_calls": False}, "You must call one of these functions"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, 'You must call the function "get_time"'),
    ({"parallel_tool_calls": False}, "Call at most one function per reply."),
])
def test_the_instruction_follows_the_tool_choice(fields, words):
    assert words in fallback_messages(chat(tools=[WEATHER, TIME], **fields))[0]["content"]


def valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_no_call_is_forced_under_auto_or_none_or_without_tools():
    assert call_schema(chat()) is None
    assert call_schema(chat(tools=[WEATHER])) is None
    assert call_schema(chat(tools=[WEATHER], tool_choice="none")) is None


def test_a_named_function_is_one_call_object():
    schema = call_schema(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    jsonschema.Draft202012Validator.check_schema(schema)
    assert valid(schema, {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}})
    for wrong in [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}},
                  {"name": "get_weather", "arguments": {"city": "Paris", "wind": 1}},
                  {"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1},
                  {"name": "get_weather"}, [{"name": "get_weather", "arguments": {"city": "Paris"}}]]:
        assert not valid(schema, wrong), wrong


def test_required_without_parallel_calls_is_one_call_of_any_tool():
    schema = call_schema(chat(tools=[WEATHER, TIME, TREE], tool_choice="required", parallel_tool_calls=False))
    assert valid(schema, {"name": "get_time", "arguments": {}})
    assert valid(schema, {"name": "plant", "arguments": {"root": {"name": "a", "kids": [{"name": "b"}]}}})
    assert not valid(schema, {"name": "plant", "arguments": {"root": {"name": "a", "kids": [{"kids": []}]}}})
    assert not valid(schema, {"name": "get_weather", "arguments": {"unit": "C"}})
    assert not valid(schema, {"name": "nope", "arguments": {}})


def test_required_with_parallel_calls_is_an_array_of_one_or_more_calls():
    schema = call_schema(chat(tools=[WEATHER, TREE], tool_choice="required"))
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}},
             {"name": "plant", "arguments": {"root": {"name": "a", "kids": [{"name": "b", "kids": []}]}}}]
    assert valid(schema, calls) and valid(schema, calls[:1])
    assert not valid(schema, []) and not valid(schema, calls[0])
    assert not valid(schema, [{"name": "plant", "arguments": {"root": {"kids": []}}}])
    one = call_schema(chat(tools=[TREE], tool_choice="required"))
    assert valid(one, calls[1:]) and not valid(one, [{"name": "plant", "arguments": {"root": {}}}])


def test_output_constraint_prefers_a_forced_call_over_the_response_format():
    person = {"type": "object", "properties": {"name": {"type": "string"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}
    assert output_constraint(chat()) is None
    assert output_constraint(chat(response_format={"type": "text"})) is None
    assert output_constraint(chat(response_format={"type": "json_object"})) == ("json_object", None)
    assert output_constraint(chat(response_format=response_format)) == ("json_schema", person)
    assert output_constraint(chat(response_format=response_format, tools=[WEATHER])) == ("json_schema", person)
    forced = chat(response_format=response_format, tools=[WEATHER], tool_choice="required")
    assert output_constraint(forced) == ("json_schema", call_schema(forced))


def calls_of(text, **fields):
    calls = parse_tool_calls(text, chat(tools=[WEATHER, TIME], **fields))
    if calls is None:
        return None
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_forced_calls_are_the_whole_output_object_or_array():
    parallel = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    assert calls_of(parallel, tool_choice="required") == [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    single = '{"name": "get_weather", "arguments": {"city": "Zürich"}}'
    assert calls_of(single, tool_choice="required", parallel_tool_calls=False) == [
        ("get_weather", '{"city":"Zürich"}')]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert calls_of(single, tool_choice=named) == [("get_weather", '{"city":"Zürich"}')]
    assert calls_of('{"name": "get_time", "arguments": {}}', tool_choice=named) is None
    assert calls_of('{"name": "get_weather", "arguments": {"city": "Pa', tool_choice="required") is None


def test_auto_reads_hermes_blocks_and_bare_call_json():
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "parameters": "{}"}</tool_call>')
    assert calls_of(text) == [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert calls_of('<tool_call>\n{"name": "get_time", "arguments": {}}') == [("get_time", "{}")]  # stopped unclosed
    assert calls_of(' {"name": "get_time", "arguments": {}} ') == [("get_time", "{}")]
    assert calls_of('[{"name": "get_time", "arguments": {}}]') == [("get_time", "{}")]


@pytest.mark.parametrize("text", [
    "It is sunny in Paris.",
    '{"city": "Paris"}',
    '<tool_call>{"name": "get_news", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": "not json"}</tool_call>',
    "<tool_call>not json</tool_call>",
    '[1, "two"]',
])
def test_outputs_without_a_known_call_are_content(text):
    assert calls_of(text) is None


def test_unknown_names_are_dropped_and_without_parallel_calls_only_the_first_is_kept():
    text = ('<tool_call>{"name": "get_news", "arguments": {}}</tool_call><tool_call>{"name": "get_time", '
            '"arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert calls_of(text) == [("get_time", "{}"), ("get_weather", '{"city":"Oslo"}')]
    assert calls_of(text, parallel_tool_calls=False) == [("get_time", "{}")]


def test_no_calls_are_read_under_none_or_without_tools():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert calls_of(text, tool_choice="none") is None
    assert parse_tool_calls(text, chat()) is None


def test_call_schemas_stay_in_the_supported_subset():
    for fields in [{"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": False},
                   {"tool_choice": {"type": "function", "function": {"name": "plant"}}}]:
        check_schema(call_schema(chat(tools=[WEATHER, TIME, TREE], **fields)), "call")

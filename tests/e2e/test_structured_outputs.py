"""Structured outputs and tools on the real default model (SmolLM2-135M-Instruct), through the
official openai SDK against a live server on PostgreSQL and SeaweedFS with the embedded worker:
every output parses and validates against its schema (``jsonschema``), a line with a schema the
service cannot enforce fails alone, and a schema shared by a batch compiles once."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from tests.utils.batch_service import embedded_stack, run_to_end

SETTINGS = dict(shard_size=8, max_num_seqs=16, auth_required=False)
LABELS = ["positive", "negative", "neutral"]
CLASSIFY = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": LABELS}},
    "required": ["label"],
    "additionalProperties": False,
}
EXTRACT = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                           "address": {"$ref": "#/$defs/address"}},
            "required": ["name", "age", "address"], "additionalProperties": False}},
        "topic": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
    },
    "required": ["people", "topic"],
    "additionalProperties": False,
    "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir, s3):
    with embedded_stack(tmp_path_factory.mktemp("structured"), smollm2_dir, "structured", s3,
                        **SETTINGS) as server:
        yield server


def line(custom_id: str, model: str, messages: list[dict] | str, **body) -> dict:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": messages, "temperature": 0, "max_tokens": 200, **body}}


def run(openai_client: OpenAI, lines: list[dict]):
    return run_to_end(openai_client, lines, "/v1/chat/completions")


def message(record: dict) -> tuple[dict, dict]:
    body = record["response"]["body"]
    return body["choices"][0], body


def compiles(server) -> int:
    return server.worker.runner.front.grammar_compiles


REVIEWS = ["I love this phone, the battery is great.", "Terrible service, I want my money back.",
           "The package arrived on Tuesday.", "Best coffee in town!", "It broke after one day.",
           "The manual is twelve pages long."]


def test_a_classification_batch_follows_its_enum_schema_and_compiles_it_once(openai_client, server, model):
    before = compiles(server)
    response_format = {"type": "json_schema", "json_schema": {"name": "sentiment", "schema": CLASSIFY, "strict": True}}
    lines = [line(f"c{i}", model, f"Classify the sentiment of this review: {text}", response_format=response_format)
             for i, text in enumerate(REVIEWS)]
    batch, output, errors = run(openai_client, lines)
    assert errors == {} and sorted(output) == [f"c{i}" for i in range(len(REVIEWS))]
    assert batch.request_counts.completed == len(REVIEWS)
    for record in output.values():
        choice, body = message(record)
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), CLASSIFY)
        assert choice["message"]["refusal"] is None and "tool_calls" not in choice["message"]
        assert body["system_fingerprint"].startswith("fp_") and body["id"].startswith("chatcmpl-")
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert len({message(r)[1]["system_fingerprint"] for r in output.values()}) == 1
    assert compiles(server) - before == 1  # six requests, one schema: one compile


def test_an_extraction_batch_with_nested_objects_arrays_and_refs_validates(openai_client, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "people", "schema": EXTRACT, "strict": True}}
    texts = ["Anna (34) lives in Oslo and Ben (29) in Rome; they met at a chess club.",
             "Carlos is 51 and works in Lima.", "Dana, 40, moved from Paris to Berlin last year."]
    lines = [line(f"x{i}", model, f"Extract the people, their ages and cities from: {text}",
                  response_format=response_format, max_tokens=300) for i, text in enumerate(texts)]
    _, output, errors = run(openai_client, lines)
    assert errors == {} and len(output) == len(texts)
    for record in output.values():
        choice, _ = message(record)
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        jsonschema.validate(value, EXTRACT)
        assert 1 <= len(value["people"]) <= 3


def test_json_object_outputs_one_json_object(openai_client, model):
    lines = [line(f"j{i}", model, f'Reply with a JSON object like {{"name": "...", "color": "..."}} for a {thing}.',
                  response_format={"type": "json_object"}) for i, thing in enumerate(["cat", "car", "city"])]
    _, output, errors = run(openai_client, lines)
    assert errors == {} and len(output) == 3
    for record in output.values():
        choice, _ = message(record)
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def assert_valid_calls(choice: dict, allowed: set[str]) -> list[dict]:
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None and choice["message"]["refusal"] is None
    calls = choice["message"]["tool_calls"]
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in allowed
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    return calls


def test_tools_with_each_tool_choice(openai_client, model):
    ask = "What is the weather in Paris right now?"
    tools = [WEATHER, TIME]
    lines = [
        line("required", model, ask, tools=tools, tool_choice="required", parallel_tool_calls=False),
        line("required-parallel", model, ask, tools=tools, tool_choice="required"),
        line("named", model, ask, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}}),
        line("auto", model, ask, tools=tools, tool_choice="auto"),
        line("none", model, ask, tools=tools, tool_choice="none"),
    ]
    _, output, errors = run(openai_client, lines)
    assert errors == {} and len(output) == 5
    assert len(assert_valid_calls(message(output["required"])[0], {"get_weather", "get_time"})) == 1
    assert assert_valid_calls(message(output["required-parallel"])[0], {"get_weather", "get_time"})
    [named] = assert_valid_calls(message(output["named"])[0], {"get_time"})
    assert named["function"]["name"] == "get_time"
    auto, _ = message(output["auto"])  # the model decides: either valid calls or plain text
    if auto["message"].get("tool_calls"):
        assert_valid_calls(auto, {"get_weather", "get_time"})
    else:
        assert isinstance(auto["message"]["content"], str) and auto["finish_reason"] in ("stop", "length")
    none, _ = message(output["none"])
    assert isinstance(none["message"]["content"], str) and "tool_calls" not in none["message"]


def test_a_multi_turn_tool_conversation_is_accepted_and_answered(openai_client, model):
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    lines = [line("answer", model, conversation, tools=[WEATHER], max_tokens=60),
             line("again", model, conversation + [{"role": "assistant", "content": "It is 18 C and clear."},
                                                  {"role": "user", "content": "And the time there?"}],
                  tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})]
    _, output, errors = run(openai_client, lines)
    assert errors == {} and len(output) == 2
    answer, body = message(output["answer"])
    assert answer["finish_reason"] in ("stop", "length", "tool_calls")
    assert body["usage"]["prompt_tokens"] > 0
    [call] = assert_valid_calls(message(output["again"])[0], {"get_time"})
    assert call["function"]["name"] == "get_time"


def test_a_line_with_a_schema_the_service_cannot_enforce_fails_alone(openai_client, model):
    unsupported = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                   "additionalProperties": False, "if": {"required": ["a"]}}
    good = {"type": "json_schema", "json_schema": {"name": "ok", "schema": CLASSIFY}}
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": unsupported}}
    lines = [line("good-0", model, "Classify: great!", response_format=good),
             line("bad", model, "Classify: awful!", response_format=bad),
             line("good-1", model, "Classify: fine.", response_format=good)]
    batch, output, errors = run(openai_client, lines)
    assert sorted(output) == ["good-0", "good-1"] and list(errors) == ["bad"]
    refusal = errors["bad"]["response"]
    assert refusal["status_code"] == 400
    assert refusal["body"]["error"]["code"] == "invalid_json_schema"
    assert "'if'" in refusal["body"]["error"]["message"]
    assert batch.request_counts.failed == 1 and batch.request_counts.completed == 2
    [early] = batch.model_extra["request_errors"]["data"]  # reported at validation, with its line
    assert (early["line"], early["code"]) == (2, "invalid_json_schema")

"""Batches on /v1/responses with the real default model (SmolLM2-135M-Instruct), through the
official openai SDK against a live server on PostgreSQL and SeaweedFS with the embedded worker:
every output body is a Response the SDK's type parses, structured outputs and forced calls
validate, a built-in tool fails its line alone, and the batch's usage is the sum of its
responses' usage."""

from __future__ import annotations

import io
import json

import jsonschema
import pytest
from openai import OpenAI
from openai.types.responses import Response

from tests.utils.batch_service import embedded_stack, jsonl, run_to_end
from tests.utils.waiting import PAST_VALIDATION, wait_for_batch

SETTINGS = dict(shard_size=4, max_num_seqs=16, auth_required=False)
URL = "/v1/responses"
SENTIMENT = {"type": "object", "properties": {"label": {"type": "string", "enum": ["positive", "negative"]},
                                              "reason": {"type": "string", "maxLength": 40}},
             "required": ["label", "reason"], "additionalProperties": False}
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                       "unit": {"type": "string", "enum": ["c", "f"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": WEATHER_PARAMETERS, "strict": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir, s3):
    with embedded_stack(tmp_path_factory.mktemp("responses"), smollm2_dir, "responses", s3,
                        **SETTINGS) as server:
        yield server


def line(custom_id: str, model: str, input, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": URL,
            "body": {"model": model, "input": input, "temperature": 0, "max_output_tokens": 120, **body}}


def run(openai_client: OpenAI, lines: list[dict]):
    return run_to_end(openai_client, lines, URL)


def response(record: dict) -> Response:
    assert record["response"]["status_code"] == 200 and record["error"] is None
    return Response.model_validate(record["response"]["body"])


def test_a_responses_batch_of_text_schemas_calls_and_a_built_in_tool(openai_client, model):
    lines = [
        line("hello", model, "Say hello in one short sentence.", instructions="You are terse."),
        line("chat", model, [{"role": "developer", "content": "Answer in one word."},
                             {"role": "user", "content": [{"type": "input_text", "text": "What color is the sky?"}]}],
             metadata={"case": "items"}, store=True),
        line("schema", model, "Classify the sentiment of this review: I love this phone!",
             text={"format": {"type": "json_schema", "name": "sentiment", "schema": SENTIMENT, "strict": True}}),
        line("call", model, "What is the weather in Paris right now?", tools=[WEATHER],
             tool_choice={"type": "function", "name": "get_weather"}),
        line("web", model, "Find today's news.", tools=[{"type": "web_search"}]),
    ]
    batch, output, errors = run(openai_client, lines)
    assert batch.endpoint == URL
    assert sorted(output) == ["call", "chat", "hello", "schema"] and list(errors) == ["web"]
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)

    refused = errors["web"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["code"] == "invalid_value"
    error = refused["body"]["error"]
    assert error["param"] == "tools[0].type" and "'web_search'" in error["message"]
    [early] = batch.model_extra["request_errors"]["data"]  # reported at validation, with its line
    assert (early["line"], early["param"]) == (5, "body.tools[0].type")

    responses = {custom_id: response(record) for custom_id, record in output.items()}
    for body in responses.values():
        assert body.id.startswith("resp_") and body.object == "response" and body.model == model
        assert body.usage.total_tokens == body.usage.input_tokens + body.usage.output_tokens
        assert body.usage.output_tokens_details.reasoning_tokens == 0 and body.error is None
    hello = responses["hello"]
    assert hello.status == "completed" and hello.output[0].type == "message" and hello.output_text.strip()
    assert hello.instructions == "You are terse."
    assert responses["chat"].metadata == {"case": "items"} and responses["chat"].output_text.strip()

    schema = responses["schema"]
    assert schema.status == "completed" and schema.text.format.type == "json_schema"
    jsonschema.validate(json.loads(schema.output_text), SENTIMENT)

    [call] = responses["call"].output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert responses["call"].tool_choice.name == "get_weather" and responses["call"].tools[0].name == "get_weather"

    usage = batch.usage  # the batch's usage is what its responses report, so its cost is theirs too
    assert usage.input_tokens == sum(r.usage.input_tokens for r in responses.values())
    assert usage.output_tokens == sum(r.usage.output_tokens for r in responses.values())
    assert usage.input_tokens_details.cached_tokens == sum(
        r.usage.input_tokens_details.cached_tokens for r in responses.values())
    assert float(batch.model_extra["cost"]["amount"]) > 0


def test_a_function_call_conversation_is_answered(openai_client, model):
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": json.dumps({"city": "Paris", "unit": "c"})},
        {"type": "function_call_output", "call_id": "call_1", "output": json.dumps({"temperature": 18})},
    ]
    lines = [line("answer", model, conversation, tools=[WEATHER], tool_choice="none", max_output_tokens=40),
             line("short", model, "Count from one to fifty in words.", max_output_tokens=3)]
    batch, output, errors = run(openai_client, lines)
    assert errors == {} and sorted(output) == ["answer", "short"]
    answer = response(output["answer"])
    assert answer.output[0].type == "message" and answer.usage.input_tokens > 0
    short = response(output["short"])
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 3)
    assert short.output[0].status == "incomplete"
    assert batch.usage.output_tokens == answer.usage.output_tokens + 3


def test_a_line_for_another_endpoint_fails_the_responses_batch(openai_client, model):
    chat_line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
    uploaded = openai_client.files.create(file=("batch.jsonl", io.BytesIO(jsonl([line("r", model, "hi"), chat_line]))),
                                   purpose="batch")
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint=URL, completion_window="24h")
    batch = wait_for_batch(openai_client, batch.id, PAST_VALIDATION, timeout=60)
    assert batch.status == "failed"
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [("invalid_url", 2, "url")]

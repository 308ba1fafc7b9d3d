"""Reasoning through the unmodified openai and anthropic SDKs, against a live server on PostgreSQL and
SeaweedFS with the embedded worker, on a tiny random Qwen3 model whose chat template thinks: thinking
on and off, budgets enforced (the engine's token counts), the thinking kept out of the answer, a JSON
schema and a forced tool call that validate after the thinking, the Responses reasoning item, and
Message Batches' signed thinking blocks, verified when sent back and refused when forged."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from anthropic.types import TextBlock, ThinkingBlock

from tests.utils.batch_service import embedded_stack, run_to_end
from tests.utils.waiting import wait_for_message_batch

SETTINGS = dict(shard_size=8, max_num_seqs=16, auth_required=False)
LABEL = {"type": "object", "properties": {"label": {"type": "string", "enum": ["yes", "no"]}},
         "required": ["label"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}
LOW = 1024  # reasoning_effort "low"; also Anthropic's least budget_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_thinking_dir, s3):
    with embedded_stack(tmp_path_factory.mktemp("reasoning"), tiny_thinking_dir, "reasoning", s3,
                        **SETTINGS) as server:
        yield server


def chat(custom_id: str, model: str, text: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, **body}}


def test_chat_thinking_on_and_off(openai_client, model):
    lines = [
        chat("off", model, "Is it raining?", reasoning_effort="none", max_completion_tokens=12),
        chat("json", model, "Is it raining?", reasoning_effort="low", max_completion_tokens=LOW + 40, logprobs=True,
             response_format={"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL, "strict": True}}),
        chat("tool", model, "Weather in Oslo?", reasoning_effort="low", max_completion_tokens=LOW + 40,
             tools=[TOOL], tool_choice="required"),
        chat("default", model, "Hello", max_completion_tokens=8, prompt_cache_key="k", safety_identifier="s"),
    ]
    batch, out, errors = run_to_end(openai_client, lines, "/v1/chat/completions")
    assert not errors
    thought = [line["response"]["body"]["usage"]["completion_tokens_details"]["reasoning_tokens"] for line in out.values()]
    assert batch.usage.output_tokens_details.reasoning_tokens == sum(thought) > 2 * LOW  # the batch sums its lines
    off = out["off"]["response"]["body"]
    assert "reasoning_content" not in off["choices"][0]["message"] and off["choices"][0]["message"]["content"]
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0

    body = out["json"]["response"]["body"]
    message = body["choices"][0]["message"]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == LOW + 2  # the budget, and two markers
    assert message["reasoning_content"] and "<think>" not in message["reasoning_content"]
    tokens = [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]  # count them, one by one
    assert tokens[0] == "<think>" and tokens.index("</think>") == LOW + 1
    assert "".join(tokens[1: LOW + 1]).strip() == message["reasoning_content"]
    jsonschema.validate(json.loads(message["content"]), LABEL)  # the schema holds after the thinking
    assert "</think>" not in message["content"] and body["choices"][0]["finish_reason"] == "stop"

    tool = out["tool"]["response"]["body"]["choices"][0]
    assert tool["finish_reason"] == "tool_calls" and tool["message"]["reasoning_content"]
    jsonschema.validate(json.loads(tool["message"]["tool_calls"][0]["function"]["arguments"]),
                        TOOL["function"]["parameters"])

    default = out["default"]["response"]["body"]  # the template thinks unless told not to: all 8 tokens thought
    assert default["choices"][0]["message"]["content"] == "" and default["choices"][0]["finish_reason"] == "length"
    assert default["choices"][0]["message"]["reasoning_content"]
    assert default["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8


def test_responses_reasoning_item(openai_client, model):
    line = {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": {
        "model": model, "input": "Is it raining?", "reasoning": {"effort": "low"}, "max_output_tokens": LOW + 40,
        "temperature": 0, "text": {"format": {"type": "json_schema", "name": "label", "schema": LABEL}}}}
    _, out, errors = run_to_end(openai_client, [line], "/v1/responses")
    assert not errors
    response = out["r"]["response"]["body"]
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["output"][0]["content"][0]["text"] and response["output"][0]["summary"] == []
    jsonschema.validate(json.loads(response["output"][1]["content"][0]["text"]), LABEL)
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == LOW + 2
    assert response["reasoning"] == {"effort": "low", "summary": None}


def test_message_batches_sign_thinking_and_refuse_forged_blocks(server, model):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Is it raining?"}]
    batch = client.messages.batches.create(requests=[
        {"custom_id": "think", "params": {"model": model, "max_tokens": LOW + 24, "messages": ask, "temperature": 0,
                                          "thinking": {"type": "enabled", "budget_tokens": LOW}}},
        {"custom_id": "plain", "params": {"model": model, "max_tokens": 8, "messages": ask,
                                          "thinking": {"type": "disabled"}}},
        {"custom_id": "forced", "params": {"model": model, "max_tokens": LOW + 24, "messages": ask,
                                           "thinking": {"type": "enabled", "budget_tokens": LOW},
                                           "tools": [{"name": "t", "input_schema": {"type": "object"}}],
                                           "tool_choice": {"type": "any"}}},
    ])
    wait_for_message_batch(client, batch.id)
    got = {item.custom_id: item.result for item in client.messages.batches.results(batch.id)}
    think = got["think"].message
    assert isinstance(think.content[0], ThinkingBlock) and isinstance(think.content[1], TextBlock)
    assert think.content[0].thinking and think.content[0].signature and think.usage.output_tokens >= LOW + 2
    assert [type(b) for b in got["plain"].message.content] == [TextBlock]
    assert got["forced"].type == "errored" and "tool_choice" in got["forced"].error.error.message

    block = think.content[0]
    turns = [*ask, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": block.thinking, "signature": block.signature},
        {"type": "text", "text": think.content[1].text or "Yes."}]}, {"role": "user", "content": "Why?"}]
    forged = [*turns[:1], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": block.thinking + " (edited)", "signature": block.signature},
        {"type": "text", "text": "Yes."}]}, turns[2]]
    again = client.messages.batches.create(requests=[
        {"custom_id": "sent-back", "params": {"model": model, "max_tokens": 8, "messages": turns,
                                              "thinking": {"type": "disabled"}}},
        {"custom_id": "forged", "params": {"model": model, "max_tokens": 8, "messages": forged}},
    ])
    wait_for_message_batch(client, again.id)
    got = {item.custom_id: item.result for item in client.messages.batches.results(again.id)}
    assert got["sent-back"].type == "succeeded"
    assert got["forged"].type == "errored" and "signature" in got["forged"].error.error.message

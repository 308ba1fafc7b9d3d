"""Response bodies: tool calls in the message, OpenAI's usage details, fingerprint and ids."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchapi.openai.body import CHAT, COMPLETIONS, parse_body
from batchapi.openai.render import completion_body

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def result(*texts: str, finish_reason: str = "stop", logprobs=None):
    outputs = [SimpleNamespace(index=i, text=text, token_ids=[1] * len(text), finish_reason=finish_reason,
                               logprobs=logprobs) for i, text in enumerate(texts)]
    return SimpleNamespace(request_id="engine-7", prompt_tokens=11, cached_tokens=4, error=None, outputs=outputs,
                           completion_tokens=sum(len(o.token_ids) for o in outputs))


def chat(**fields):
    return parse_body(CHAT, {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], **fields})


def test_a_text_answer_has_refusal_null_and_openai_usage_details():
    body = completion_body(chat(), result("Sunny."), "smollm2", FakeTokenizer(), system_fingerprint="fp_abc")
    ChatCompletion.model_validate(body)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", body["id"]) and "engine-7" not in body["id"]
    assert (body["object"], body["model"], body["system_fingerprint"], body["service_tier"]) == (
        "chat.completion", "smollm2", "fp_abc", "default")
    assert body["choices"] == [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                "message": {"role": "assistant", "content": "Sunny.", "refusal": None}}]
    assert body["usage"] == {
        "prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 4, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0}}


def test_calls_become_tool_calls_with_content_null():
    body = completion_body(chat(tools=[WEATHER]), result(CALL_TEXT, "Just text."), "m", FakeTokenizer())
    ChatCompletion.model_validate(body)
    calls, text = body["choices"]
    assert calls["finish_reason"] == "tool_calls"
    message = calls["message"]
    assert (message["content"], message["refusal"]) == (None, None)
    [call] = message["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert text["finish_reason"] == "stop" and text["message"] == {"role": "assistant", "content": "Just text.",
                                                                  "refusal": None}
    assert body["system_fingerprint"] is None


def test_a_forced_call_is_read_from_bare_json():
    parsed = chat(tools=[WEATHER], tool_choice="required")
    body = completion_body(parsed, result('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'), "m",
                           FakeTokenizer())
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"Oslo"}'


def test_an_output_cut_at_the_length_limit_stays_text():
    body = completion_body(chat(tools=[WEATHER]), result(CALL_TEXT, finish_reason="length"), "m", FakeTokenizer())
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == CALL_TEXT
    assert "tool_calls" not in choice["message"]


def test_calls_are_not_read_when_the_tool_choice_is_none_or_there_are_no_tools():
    for parsed in (chat(tools=[WEATHER], tool_choice="none"), chat()):
        choice = completion_body(parsed, result(CALL_TEXT), "m", FakeTokenizer())["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", CALL_TEXT)


def test_completions_get_a_fresh_id_and_the_fingerprint():
    parsed = parse_body(COMPLETIONS, {"model": "m", "prompt": "Once"})
    body = completion_body(parsed, result(" upon"), "m", FakeTokenizer(), "fp_1")
    Completion.model_validate(body)
    assert re.fullmatch(r"cmpl-[0-9a-f]{24}", body["id"]) and body["system_fingerprint"] == "fp_1"
    assert body["choices"] == [{"index": 0, "finish_reason": "stop", "text": " upon", "logprobs": None}]
    assert "service_tier" not in body


def test_each_body_has_its_own_id():
    ids = {completion_body(chat(), result("a"), "m", FakeTokenizer())["id"] for _ in range(20)}
    assert len(ids) == 20

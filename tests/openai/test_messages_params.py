"""Anthropic Messages params the SDK sends that are read, not refused: a prefill (a last assistant
turn), a tool's ``strict``; and the ones still refused, each naming its field."""

from __future__ import annotations

import pytest

from batchapi.openai.body import MESSAGES, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from tests.openai.test_messages import body, refusal

TOOL = {"name": "lookup", "description": "Look it up.",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
                         "required": ["q"]}}


@pytest.mark.parametrize("prefill", ["The answer is", [{"type": "text", "text": "The "}, {"type": "text", "text": "answer"}]])
def test_a_last_assistant_turn_is_kept_last_for_the_reply_to_continue(prefill):
    parsed = parse_body(MESSAGES, body(messages=[{"role": "user", "content": "What is 6 x 7?"},
                                                 {"role": "assistant", "content": prefill}]))
    text = prefill if isinstance(prefill, str) else "The answer"
    assert parsed.messages == [{"role": "user", "content": "What is 6 x 7?"}, {"role": "assistant", "content": text}]


@pytest.mark.parametrize("prefill", ["The answer is ", "Sure.\n", [{"type": "text", "text": "a\t"}]])
def test_a_prefill_ending_in_whitespace_is_refused_as_anthropic_refuses_it(prefill):
    error = refusal(body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": prefill}]))
    assert (error.message, error.param, error.code) == (
        "final assistant content cannot end with trailing whitespace", "messages[1].content", ErrorCode.INVALID_VALUE)


def test_only_the_last_turn_is_held_to_no_trailing_whitespace():
    parsed = parse_body(MESSAGES, body(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b "},
                                                 {"role": "user", "content": "c "}]))
    assert [m["content"] for m in parsed.messages] == ["a", "b ", "c "]


def test_a_prefill_after_tool_results_continues_the_answer():
    parsed = parse_body(MESSAGES, body(
        tools=[TOOL],
        messages=[{"role": "user", "content": "find x"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]},
                  {"role": "assistant", "content": "It is"}]))
    assert [m["role"] for m in parsed.messages] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize("strict", [True, False])
def test_a_strict_tool_is_accepted_with_optional_properties(strict):
    parsed = parse_body(MESSAGES, body(tools=[{**TOOL, "strict": strict, "eager_input_streaming": True,
                                               "cache_control": {"type": "ephemeral"}}],
                                       tool_choice={"type": "tool", "name": "lookup"}))
    assert parsed.tools == [{"type": "function", "function": {
        "name": "lookup", "description": "Look it up.", "parameters": TOOL["input_schema"]}}]
    assert (parsed.tool_choice, parsed.tool_name) == ("required", "lookup")


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"strict": "yes"}, "tools[0].strict", ErrorCode.INVALID_TYPE),
    ({"eager_input_streaming": 1}, "tools[0].eager_input_streaming", ErrorCode.INVALID_TYPE),
    ({"defer_loading": True}, "tools[0].defer_loading", ErrorCode.UNKNOWN_PARAMETER),
    ({"allowed_callers": ["direct"]}, "tools[0].allowed_callers", ErrorCode.UNKNOWN_PARAMETER),
    ({"input_examples": [{"q": "x"}]}, "tools[0].input_examples", ErrorCode.UNKNOWN_PARAMETER),
])
def test_tool_fields_of_the_wrong_type_or_of_server_features_name_their_field(extra, param, code):
    error = refusal(body(tools=[{**TOOL, **extra}]))
    assert (error.param, error.code) == (param, code)


def test_max_tokens_zero_is_refused_the_engine_runs_every_request():
    error = refusal(body(max_tokens=0))
    assert (error.param, error.code) == ("max_tokens", ErrorCode.INVALID_VALUE)


def test_a_user_turn_of_no_blocks_is_refused_as_anthropic_refuses_it():
    with pytest.raises(RequestError) as refused:
        parse_body(MESSAGES, body(messages=[{"role": "user", "content": []}]))
    assert refused.value.param == "messages[0]"
    assert refused.value.message == ("all messages must have non-empty content except for the optional final "
                                     "assistant message")

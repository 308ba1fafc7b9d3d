"""Reasoning in the three wire formats (``openai.reasoning``): what each field asks for, the markers
read from a chat template (Qwen3-style, DeepSeek-style opened, and a template that cannot think),
signatures, the refusals, and chat's accepted-and-ignored fields."""

from __future__ import annotations

import jinja2
import pytest

from batchapi.engine.request import CompletionOutput
from batchapi.openai.body import CHAT, MESSAGES, RESPONSES, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.reasoning import (
    EFFORT_BUDGETS,
    PROBE,
    Reasoning,
    ThinkingTemplate,
    probe_template,
    reasoning_error,
    sign,
    split_output,
    thinking_budget,
    thinks,
    verify,
)
from tests.utils.tiny_models import THINKING_TEMPLATE

USER = [{"role": "user", "content": "Why?"}]
QWEN3 = ThinkingTemplate("<think>", "</think>", opened=False, default_on=True)
# DeepSeek-R1's way: thinking on opens the block in the generation prompt; off closes an empty one
OPENED = """{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}\
<|assistant|>{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
PLAIN = """{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}\
<|assistant|>{% endif %}"""


def chat(**fields):
    return parse_body(CHAT, {"model": "m", "messages": USER, **fields})


def messages(**fields):
    return parse_body(MESSAGES, {"model": "m", "max_tokens": 2000, "messages": USER, **fields})


def refused(endpoint, body) -> tuple[str, str]:
    with pytest.raises(RequestError) as err:
        parse_body(endpoint, body)
    return err.value.code, err.value.param


def probe(source: str) -> ThinkingTemplate | None:
    template = jinja2.Environment().from_string(source)
    return probe_template(lambda **switch: template.render(messages=PROBE, add_generation_prompt=True, **switch))


@pytest.mark.parametrize("effort,enabled,budget", [("none", False, None), ("minimal", False, None),
                                                   ("low", True, 1024), ("medium", True, 4096), ("high", True, 16384)])
def test_chat_reasoning_effort(effort, enabled, budget):
    reasoning = chat(reasoning_effort=effort).reasoning
    assert (reasoning.enabled, reasoning.budget, reasoning.effort) == (enabled, budget, effort)
    assert EFFORT_BUDGETS.get(effort) == budget


def test_a_budget_never_exceeds_what_max_tokens_leaves():
    assert thinking_budget(chat(reasoning_effort="high", max_completion_tokens=300)) == 299
    assert thinking_budget(chat(reasoning_effort="low")) == 1024
    assert thinking_budget(chat()) is None


def test_bad_reasoning_fields_are_refused():
    assert refused(CHAT, {"model": "m", "messages": USER, "reasoning_effort": "max"}) == (
        ErrorCode.INVALID_VALUE, "reasoning_effort")
    assert refused(RESPONSES, {"model": "m", "input": "x", "reasoning": {"effort": "huge"}}) == (
        ErrorCode.INVALID_VALUE, "reasoning.effort")
    assert refused(RESPONSES, {"model": "m", "input": "x", "reasoning": {"depth": 1}}) == (
        ErrorCode.UNKNOWN_PARAMETER, "reasoning.depth")
    base = {"model": "m", "max_tokens": 2000, "messages": USER}
    for thinking, param in [({"type": "enabled", "budget_tokens": 1023}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": 2000}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": "9"}, "thinking.budget_tokens"),
                            ({"type": "sometimes"}, "thinking.type"),
                            ({"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, "thinking.display"),
                            ({"type": "disabled", "budget_tokens": 1024}, "thinking.budget_tokens")]:
        assert refused(MESSAGES, {**base, "thinking": thinking})[1] == param, thinking
    prefill = [*USER, {"role": "assistant", "content": "Because"}]
    assert refused(MESSAGES, {**base, "messages": prefill, "thinking": {"type": "enabled", "budget_tokens": 1024}}
                   )[1] == "messages[1].role"


def test_responses_and_messages_reasoning():
    parsed = parse_body(RESPONSES, {"model": "m", "input": "x", "reasoning": {"effort": "low", "summary": "auto"}})
    assert parsed.reasoning == Reasoning(True, 1024, "low", "auto", "reasoning.effort")
    assert parsed.echo["reasoning"] == {"effort": "low", "summary": "auto"}
    assert parse_body(RESPONSES, {"model": "m", "input": "x", "text": {"verbosity": "low"}}).echo["text"][
        "verbosity"] == "low"
    assert messages(thinking={"type": "enabled", "budget_tokens": 1500}).reasoning == Reasoning(
        True, 1500, param="thinking")
    assert messages(thinking={"type": "disabled"}).reasoning.enabled is False
    assert messages(thinking={"type": "adaptive"}).reasoning == Reasoning(True, None, param="thinking")


def test_thinking_blocks_sent_back_are_kept_for_the_check():
    turns = [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Let me see.", "signature": "c2ln"}, {"type": "text", "text": "Yes."}]},
        {"role": "user", "content": "And?"}]
    parsed = messages(messages=turns)
    assert parsed.signed_thinking == [("Let me see.", "c2ln", "messages[1].content[0]")]
    assert parsed.messages[1] == {"role": "assistant", "content": "Yes.", "reasoning_content": "Let me see."}
    late = [*USER, {"role": "assistant", "content": [
        {"type": "text", "text": "Yes."}, {"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}]}, USER[0]]
    assert refused(MESSAGES, {"model": "m", "max_tokens": 9, "messages": late})[1] == "messages[1].content[1]"
    unsigned = [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm."}]}, USER[0]]
    assert refused(MESSAGES, {"model": "m", "max_tokens": 9, "messages": unsigned}) == (
        ErrorCode.MISSING_REQUIRED_PARAMETER, "messages[1].content[0].signature")


def test_markers_come_from_the_template():
    assert probe(THINKING_TEMPLATE) == QWEN3
    assert probe(OPENED) == ThinkingTemplate("<think>", "</think>", opened=True, default_on=True)
    assert probe(PLAIN) is None
    assert probe("{{ raise_nothing() }}") is None  # a template that fails on the probe cannot think


def test_a_model_that_cannot_think_refuses_thinking_naming_the_field():
    key = b"k"
    error = reasoning_error(chat(reasoning_effort="low"), None, key)
    assert error.param == "reasoning_effort" and "not supported with this model" in error.message
    assert reasoning_error(chat(reasoning_effort="none"), None, key) is None  # off asks nothing of it
    assert reasoning_error(messages(thinking={"type": "enabled", "budget_tokens": 1024}), None, key).param == "thinking"
    responses = parse_body(RESPONSES, {"model": "m", "input": "x", "reasoning": {"effort": "high"}})
    assert reasoning_error(responses, None, key).param == "reasoning.effort"
    assert reasoning_error(chat(reasoning_effort="low"), QWEN3, key) is None
    assert not thinks(chat(reasoning_effort="none"), QWEN3) and thinks(chat(), QWEN3) and not thinks(chat(), None)


def test_signatures_verify_under_the_key_only():
    signature = sign("Let me see.", b"key-1")
    assert verify("Let me see.", signature, b"key-1")
    assert not verify("Let me see!", signature, b"key-1") and not verify("Let me see.", signature, b"key-2")
    turns = [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Let me see.", "signature": signature}, {"type": "text", "text": "Yes."}]},
        {"role": "user", "content": "And?"}]
    assert reasoning_error(messages(messages=turns), QWEN3, b"key-1") is None
    forged = reasoning_error(messages(messages=turns), QWEN3, b"key-2")
    assert forged.param == "messages[1].content[0].signature" and "Invalid `signature`" in forged.message


def test_an_output_splits_into_its_thinking_and_its_answer():
    out = CompletionOutput(0, "\n\n{\"a\": 1}", [1, 2, 3, 4, 5], "stop", thinking_tokens=3,
                           thinking_text="<think>\nHm, yes.\n</think>")
    assert split_output(out, QWEN3) == ("Hm, yes.", "{\"a\": 1}")
    cut = CompletionOutput(0, "", [1, 2, 3], "length", thinking_tokens=3, thinking_text="<think>\nStill going")
    assert split_output(cut, QWEN3) == ("Still going", "")
    plain = CompletionOutput(0, "Hello", [1], "stop")
    assert split_output(plain, QWEN3) == (None, "Hello")


def test_chat_accepts_the_fields_that_change_nothing_here():
    parsed = chat(prompt_cache_key="k", safety_identifier="user-hash", verbosity="low", user="u")
    assert parsed.messages == USER
    assert refused(CHAT, {"model": "m", "messages": USER, "verbosity": "loud"}) == (ErrorCode.INVALID_VALUE, "verbosity")
    assert refused(CHAT, {"model": "m", "messages": USER, "prompt_cache_key": 7}) == (
        ErrorCode.INVALID_TYPE, "prompt_cache_key")
    assert refused("/v1/completions", {"model": "m", "prompt": "x", "verbosity": "low"}) == (
        ErrorCode.UNKNOWN_PARAMETER, "verbosity")

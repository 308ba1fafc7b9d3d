"""What a diff compares of a result line, in every wire format the service renders: two renders of
the same engine result (new ids, timestamps, request ids, call ids, signatures under another key)
are the same output; another text, call, vector or error code is not."""

from __future__ import annotations

import struct
from types import SimpleNamespace

from batchapi.batches.diff.outcomes import preview, read_outcome
from batchapi.openai import render
from batchapi.openai.body import CHAT, COMPLETIONS, MESSAGES, RESPONSES, parse_body
from batchapi.openai.embeddings import EMBEDDINGS, embedding_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.message_results import message_body
from batchapi.openai.responses import response_body

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]


def result(text: str, reasoning: str | None = None, finish: str = "stop") -> SimpleNamespace:
    out = SimpleNamespace(index=0, text=text, finish_reason=finish, logprobs=None, token_ids=[1, 2, 3],
                          reasoning=reasoning, thinking_tokens=2 if reasoning else 0)
    return SimpleNamespace(error=None, outputs=[out], prompt_tokens=11, completion_tokens=3, cached_tokens=4,
                           request_id="r", parts=None)


def outcome_of(body: dict):
    return read_outcome(render.succeeded("q1", body).rstrip(b"\n"))


def test_chat_tool_calls_compare_without_their_ids_and_with_the_fingerprint_apart():
    parsed = parse_body(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                               "tool_choice": "auto"})
    call = '<tool_call>{"name": "get", "arguments": {"x": 1}}</tool_call>'
    one, two = (outcome_of(render.completion_body(parsed, result(call), "m", None, "fp_1")) for _ in range(2))
    assert one.output[0]["message"]["tool_calls"] == [{"type": "function",
                                                       "function": {"name": "get", "arguments": '{"x":1}'}}]
    assert one.digest == two.digest and one.succeeded and one.custom_id == "q1"
    assert (one.prompt_tokens, one.completion_tokens, one.system_fingerprint) == (11, 3, "fp_1")
    assert preview(one) == 'get({"x":1})'
    other = outcome_of(render.completion_body(parsed, result(call.replace("1", "2")), "m", None, "fp_1"))
    assert other.digest != one.digest
    elsewhere = outcome_of(render.completion_body(parsed, result(call), "m", None, "fp_2"))
    assert elsewhere.digest == one.digest and elsewhere.system_fingerprint == "fp_2"


def test_completions_and_responses():
    parsed = parse_body(COMPLETIONS, {"model": "m", "prompt": "x"})
    one, two = (outcome_of(render.completion_body(parsed, result("abc"), "m", None, "fp")) for _ in range(2))
    assert one.digest == two.digest and preview(one) == "abc"
    assert outcome_of(render.completion_body(parsed, result("abd"), "m", None, "fp")).digest != one.digest

    parsed = parse_body(RESPONSES, {"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "get", "parameters": {"type": "object"}}]})
    call = '<tool_call>{"name": "get", "arguments": {"x": 1}}</tool_call>'
    one, two = (outcome_of(response_body(parsed, result(call, reasoning="hmm"), "m")) for _ in range(2))
    assert one.digest == two.digest and one.system_fingerprint is None
    assert (one.prompt_tokens, one.completion_tokens) == (11, 3)
    assert preview(one) == 'thinking: hmm | get({"x":1})'
    assert outcome_of(response_body(parsed, result(call, reasoning="hm"), "m")).digest != one.digest


def test_messages_thinking_signatures_and_tool_use_ids_are_not_output():
    parsed = parse_body(MESSAGES, {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]})
    one = outcome_of(message_body(parsed, result("hi", reasoning="think"), "m", None, key=b"a"))
    two = outcome_of(message_body(parsed, result("hi", reasoning="think"), "m", None, key=b"b"))
    assert one.digest == two.digest and preview(one) == "thinking: think | hi"
    assert (one.prompt_tokens, one.completion_tokens) == (11, 3)  # uncached 7 plus 4 read from the cache
    assert outcome_of(message_body(parsed, result("ho", reasoning="think"), "m", None)).digest != one.digest

    parsed = parse_body(MESSAGES, {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
                                   "tools": [{"name": "get", "input_schema": {"type": "object"}}]})
    call = '<tool_call>{"name": "get", "arguments": {"x": 1}}</tool_call>'
    one, two = (outcome_of(message_body(parsed, result(call), "m", None)) for _ in range(2))
    assert one.output["stop_reason"] == "tool_use" and one.digest == two.digest


def test_embedding_vectors_compare_exactly():
    parsed = parse_body(EMBEDDINGS, {"model": "e", "input": ["a"]})
    vector = struct.pack("<3f", 0.5, -0.25, 1.0)

    def outcome(v: bytes):
        return outcome_of(embedding_body(parsed, SimpleNamespace(error=None, vectors=[v], prompt_tokens=5,
                                                                 request_id="r"), "e"))

    one, two = outcome(vector), outcome(vector)
    assert one.digest == two.digest and (one.prompt_tokens, one.completion_tokens) == (5, 0)
    assert preview(one) == "vector 0: 3 values [0.5, -0.25, 1, …]"
    assert outcome(struct.pack("<3f", 0.5, -0.25, 1.0000001)).digest != one.digest


def test_failures_compare_by_their_code():
    refused = read_outcome(render.rejected("q", RequestError("bad top_p", "top_p")).rstrip(b"\n"))
    again = read_outcome(render.rejected("q", RequestError("bad top_p", "top_p")).rstrip(b"\n"))
    expired = read_outcome(render.never_ran("q", ErrorCode.BATCH_EXPIRED).rstrip(b"\n"))
    assert not refused.succeeded and refused.digest == again.digest and refused.digest != expired.digest
    assert refused.output == {"status_code": 400, "code": "invalid_value"}
    assert preview(expired) == "batch_expired: The batch expired before this request finished."

"""Which requests the result cache may answer, and under which key (``batches.result_cache.key``)."""

from __future__ import annotations

from batchapi.batches.result_cache import key
from batchapi.openai.body import ParsedBody

MESSAGES = [{"role": "user", "content": "Say hello."}]


def body(**fields) -> ParsedBody:
    return ParsedBody(**{"model": "m", "messages": MESSAGES, "max_tokens": 5, **fields})


def test_greedy_and_seeded_requests_have_a_key_sampled_ones_none():
    assert key("m", "fp", body(temperature=0)) is not None
    assert key("m", "fp", body(temperature=1.0, seed=7)) is not None
    assert key("m", "fp", body(temperature=1.0)) is None
    assert key("m", None, body(temperature=0)) is None  # no fingerprint: nothing ties it to an engine


def test_the_key_follows_model_fingerprint_and_every_body_field():
    greedy = key("m", "fp", body(temperature=0))
    assert greedy == key("m", "fp", body(temperature=0))
    assert len({greedy, key("other", "fp", body(temperature=0)), key("m", "fp2", body(temperature=0)),
                key("m", "fp", body(temperature=0, max_tokens=6)), key("m", "fp", body(temperature=0, logprobs=True)),
                key("m", "fp", body(temperature=1.0, seed=7)), key("m", "fp", body(temperature=1.0, seed=8))}) == 7


# bodies with nested dataclasses, int-keyed dicts, tuples and token-id prompts, as lines parse them
KEYED_LINES = [
    {"url": "/v1/completions", "body": {"model": "m", "prompt": list(range(300)), "max_tokens": 0, "echo": True,
                                        "logprobs": 1, "temperature": 0}},
    {"url": "/v1/completions", "body": {"model": "m", "prompt": [[4, 5], [1, 2, 3]], "seed": 1, "n": 2}},
    {"url": "/v1/chat/completions", "body": {
        "model": "m", "temperature": 0, "logit_bias": {"5": 1.5, "12": -2}, "stop": ["x"], "reasoning_effort": "low",
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "3"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}}}}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": {
            "type": "object", "properties": {"y": {"type": "string"}}, "required": ["y"],
            "additionalProperties": False}}}}},
    {"url": "/v1/responses", "body": {"model": "m", "input": "hello", "instructions": "be brief", "temperature": 0,
                                      "reasoning": {"effort": "high"}}},
]


def test_the_key_is_the_hash_of_the_bodys_asdict_json():
    """Entries stored under the first form of the key (``dataclasses.asdict`` of the body) keep matching."""
    import dataclasses
    import hashlib
    import json

    from batchapi.openai.lines import parse_line

    for i, line in enumerate(KEYED_LINES):
        parsed = parse_line(json.dumps({"custom_id": str(i), "method": "POST", **line}).encode(), i + 1, line["url"])
        assert parsed.body is not None, parsed.error
        canonical = json.dumps({"model": "m", "system_fingerprint": "fp", "body": dataclasses.asdict(parsed.body)},
                               sort_keys=True, separators=(",", ":"), default=repr)
        assert key("m", "fp", parsed.body) == hashlib.sha256(canonical.encode()).hexdigest(), line

"""Grammars in the engine, on a tiny random model: constrained rows follow their schema whatever
the weights say, unconstrained rows beside them are untouched, n > 1 forks get matchers of their
own, a refused schema fails its request alone, and a shared schema compiles once."""

from __future__ import annotations

import json

import jsonschema

from batchapi.engine import ErrorCode, GenerationRequest, SamplingParams
from batchapi.grammar import GrammarSpec
from tests.engine.test_engine import engine_for, tokenize

ENUM = {"type": "object", "properties": {"label": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                         "score": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["label", "score"], "additionalProperties": False}
PROMPTS = ["Is the sky blue?", "Name a fruit.", "Count to three.", "Say something."]


def run(engine, requests):
    for request in requests:
        engine.add_request(request)
    results = {}
    while engine.has_unfinished():
        for result in engine.step():
            results[result.request_id] = result
    return results


def test_constrained_rows_follow_the_schema_and_leave_other_rows_alone(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    ids = tokenize(tiny_llama_dir, PROMPTS)
    spec = GrammarSpec.json_schema(ENUM)
    free = [GenerationRequest(f"free{i}", p, SamplingParams(max_tokens=12, temperature=0.8, seed=i))
            for i, p in enumerate(ids)]
    alone = run(engine, free)
    constrained = [
        GenerationRequest(f"json{i}", p, SamplingParams(max_tokens=64, temperature=t, seed=i, n=2, grammar=spec))
        for i, (p, t) in enumerate(zip(ids, [0.0, 0.7, 1.0, 1.3], strict=True))
    ]
    mixed = run(engine, [GenerationRequest(r.request_id, r.prompt_token_ids, r.params) for r in free] + constrained)
    for request in free:  # seeded rows beside constrained ones: the very same tokens
        assert mixed[request.request_id].outputs[0].token_ids == alone[request.request_id].outputs[0].token_ids
    for request in constrained:
        result = mixed[request.request_id]
        assert result.error is None and len(result.outputs) == 2
        for out in result.outputs:  # each fork has its own matcher
            assert out.finish_reason == "stop", out
            jsonschema.validate(json.loads(out.text), ENUM)
    assert engine.grammars.compiles == 1  # four requests, eight sequences, one schema


def test_a_refused_schema_fails_its_request_alone(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    [ids] = tokenize(tiny_llama_dir, ["Hello"])
    bad = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    results = run(engine, [
        GenerationRequest("bad", ids, SamplingParams(max_tokens=8, grammar=bad)),
        GenerationRequest("object", ids, SamplingParams(max_tokens=256, temperature=0, grammar=GrammarSpec.json_object())),
        GenerationRequest("plain", ids, SamplingParams(max_tokens=4, temperature=0)),
    ])
    assert results["bad"].error_code is ErrorCode.INVALID_GRAMMAR and "schema" in results["bad"].error
    assert results["plain"].error is None and results["plain"].completion_tokens == 4
    out = results["object"].outputs[0]
    assert results["object"].error is None
    if out.finish_reason == "stop":  # a random model may fill a string until max_tokens
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.text.startswith("{")

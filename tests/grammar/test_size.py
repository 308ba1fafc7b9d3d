"""The shortest document of a schema (grammar.size) and of a pattern's match (grammar.regex_size):
infinite where a required value leads back to itself, exact bytes otherwise, and the grammar check
that refuses a schema whose shortest document cannot fit the model's context."""

from __future__ import annotations

import json
import math

import pytest

from batchapi.grammar import GrammarError, GrammarSpec, check_grammar
from batchapi.grammar.regex_size import shortest_match
from batchapi.grammar.size import shortest_document

SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
MUTUAL = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"],
          "$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
                    "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}}}
HUGE_PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{1000000}$"}},
                "required": ["s"]}


@pytest.mark.parametrize("pattern,least", [
    ("^a{1000000}$", 1_000_000), ("a+b*", 1), ("(ab|c){3}", 3), (r"[a-z]{2,5}\d", 3), ("^(?:x|yy)?z$", 1),
    ("(?=abc)a", 1), ("(?P<n>ab)(?P=n)", 2), (r"\u0041{4}", 4), ("[]a]{2}", 2), ("(?i)ab", 2), ("a{2}?", 2),
    ("x{,3}", 0), (r"^\d{3}-\d{4}$", 8), ("a{}", 3), (r"(a)\1{5}", 1), ("", 0),
])
def test_a_pattern_s_shortest_match_is_a_lower_bound(pattern, least):
    assert shortest_match(pattern) == least


@pytest.mark.parametrize("schema,pointer", [
    (SELF, ("properties", "a")),
    (MUTUAL, ("$defs", "B", "properties", "a")),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, ("items",)),
    ({"anyOf": [{"$ref": "#/$defs/L"}, {"$ref": "#/$defs/R"}],
      "$defs": {"L": {"type": "array", "items": {"$ref": "#"}, "minItems": 2},
                "R": {"type": "object", "required": ["r"], "properties": {"r": {"$ref": "#"}}}}},
     ("$defs", "L", "items")),
])
def test_a_required_recursion_with_no_way_out_has_no_finite_document(schema, pointer):
    shortest = shortest_document(schema)
    assert math.isinf(shortest.size) and shortest.pointer == pointer


@pytest.mark.parametrize("schema,document", [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, {}),  # optional: {} ends it
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, None),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, None),
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, 0),  # no type: any number satisfies it
    ({"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
      "required": ["v", "kids"]}, {"v": 0, "kids": []}),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 3}, "e": {"enum": ["long", 7]}},
      "required": ["s", "e"], "additionalProperties": False}, {"s": "xxx", "e": 7}),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 3}, [True, True, True]),
])
def test_a_finite_schema_s_shortest_document_is_exact(schema, document):
    assert shortest_document(schema).size == len(json.dumps(document, separators=(",", ":")))


def test_a_long_chain_of_defs_settles_in_one_pass_whatever_their_order():
    """In the worse order, one round per def would pass the visit budget and leave the size unknown."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(1500)}
    defs["d1500"] = {"type": "null"}
    for ordered in (defs, dict(reversed(list(defs.items())))):
        schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"], "$defs": ordered}
        shortest = shortest_document(schema)
        assert shortest.exact and shortest.size == 6 + 1500 * 6 + 4  # {"a":{"x":{"x":...null}}}


def test_a_schema_whose_shortest_document_cannot_fit_the_context_is_refused():
    spec = GrammarSpec.json_schema(HUGE_PATTERN)
    check_grammar(spec)  # the grammar engine itself takes it
    check_grammar(spec, context_bytes=2_000_000)
    with pytest.raises(GrammarError) as refused:
        check_grammar(spec, context_bytes=8192)
    assert str(refused.value) == ("no document of this schema fits the model's context: the shortest is at least "
                                  "1000008 bytes (most of them at '#/properties/s'), and the context holds at most "
                                  "8192")
    check_grammar(GrammarSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}}}), 8)
    check_grammar(GrammarSpec.json_object(), 1)  # json_object's shortest, {}, is the grammar engine's concern

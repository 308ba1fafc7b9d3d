"""The schema subset: what the grammar can enforce passes, the rest is refused by keyword and path."""

from __future__ import annotations

import pytest

from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.schema import MAX_DEPTH, MAX_PROPERTIES, check_schema

P = "response_format.json_schema.schema"

PERSON = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 80, "description": "full name"},
        "age": {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": 200},
        "email": {"type": "string", "format": "email"},
        "born": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d+$"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "kind": {"enum": ["a", "b", None]},
        "version": {"const": 2},
        "score": {"type": "number", "maximum": 1.5, "default": 0.5, "examples": [0.1]},
        "pet": {"anyOf": [{"$ref": "#/$defs/Dog"}, {"type": "null"}]},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
    "required": ["name", "age", "email", "born", "code", "tags", "kind", "version", "score", "pet", "extra"],
    "additionalProperties": False,
    "$defs": {"Dog": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                      "additionalProperties": False}},
}


def refusal(schema, strict=False, param=P) -> RequestError:
    with pytest.raises(RequestError) as caught:
        check_schema(schema, param, strict=strict)
    assert caught.value.code == ErrorCode.INVALID_JSON_SCHEMA
    assert caught.value.message.startswith(f"{caught.value.param}: ")
    return caught.value


def test_the_supported_subset_passes_in_strict_mode_too():
    check_schema(PERSON, P)
    check_schema({**PERSON, "properties": {**PERSON["properties"], "extra": {"type": "null"}}}, P, strict=True)


@pytest.mark.parametrize("keyword", [
    "allOf", "oneOf", "not", "if", "then", "else", "patternProperties", "dependentRequired", "dependentSchemas",
    "unevaluatedProperties", "unevaluatedItems", "contains", "uniqueItems", "prefixItems", "multipleOf",
    "nullable", "propertyNames", "minProperties", "$id", "$anchor", "contentEncoding",
])
def test_each_unsupported_keyword_is_named_with_its_path(keyword):
    schema = {"type": "object", "properties": {"age": {"type": "integer", keyword: True}}}
    error = refusal(schema)
    assert error.param == f"{P}.properties.age"
    assert f"the keyword {keyword!r} is not supported" in error.message


def test_hints_point_to_what_is_supported():
    assert "use 'anyOf'" in refusal({"oneOf": [{"type": "string"}]}).message
    assert "[\"string\", \"null\"]" in refusal({"type": "string", "nullable": True}).message


def test_paths_follow_items_anyof_defs_and_odd_names():
    schema = {"type": "array", "items": {"anyOf": [{"type": "string"}, {"properties": {"a b": {"not": {}}}}]}}
    assert refusal(schema).param == f"{P}.items.anyOf[1].properties['a b']"
    assert refusal({"$defs": {"X": {"type": "str"}}}).param == f"{P}.$defs.X.type"


@pytest.mark.parametrize(("schema", "param", "words"), [
    ({"type": "strin"}, f"{P}.type", "unknown type 'strin'"),
    ({"type": []}, f"{P}.type", "non-empty"),
    ({"type": "string", "pattern": "(unclosed"}, f"{P}.pattern", "not a valid regular expression"),
    ({"type": "string", "format": "color"}, f"{P}.format", "the format 'color' is not supported"),
    ({"type": "string", "minLength": -1}, f"{P}.minLength", "non-negative integer"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, P, "'minItems' is greater than 'maxItems'"),
    ({"type": "number", "minimum": 5, "maximum": 1}, P, "no number lies within its bounds"),
    ({"type": "number", "exclusiveMinimum": True}, f"{P}.exclusiveMinimum", "must be a number"),
    ({"type": "array", "items": [{"type": "string"}]}, f"{P}.items", "one schema"),
    ({"enum": []}, f"{P}.enum", "non-empty"),
    ({"properties": []}, f"{P}.properties", "must be an object"),
    ({"required": ["a", "a"]}, f"{P}.required", "distinct"),
    ({"properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, f"{P}.required",
     "'b' is required but not among the properties"),
    ({"properties": {"a": "string"}}, f"{P}.properties.a", "a schema must be an object"),
    ({"anyOf": []}, f"{P}.anyOf", "non-empty"),
])
def test_malformed_parts_are_refused(schema, param, words):
    error = refusal(schema)
    assert error.param == param and words in error.message


def test_local_refs_must_name_a_schema_of_the_document():
    check_schema({"$defs": {"a~b/c": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a~0b~1c"}}}, P)
    check_schema({"properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}, P)  # recursion
    check_schema({"definitions": {"A": {"type": "integer"}}, "items": {"$ref": "#/definitions/A"}}, P)
    check_schema({"properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}}, P)
    assert "does not name a schema" in refusal({"properties": {"x": {"$ref": "#/$defs/Missing"}}}).message
    assert "does not name a schema" in refusal({"$defs": {"A": {}}, "items": {"$ref": "#/$defs"}}).message
    error = refusal({"items": {"$ref": "https://example.com/s.json"}})
    assert error.param == f"{P}.items.$ref" and "only local references" in error.message
    assert "only local references" in refusal({"items": {"$ref": "other.json#/a"}}).message
    assert "beside annotations only" in refusal({"items": {"$ref": "#", "type": "string"}}).message
    check_schema({"items": {"$ref": "#", "description": "again"}}, P)


def test_a_cycle_of_bare_refs_is_refused():
    schema = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "items": {"$ref": "#/$defs/A"}}
    assert "cycle" in refusal(schema).message


def test_strict_mode_wants_closed_objects_with_every_property_required():
    open_object = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    check_schema(open_object, P)
    error = refusal(open_object, strict=True)
    assert error.param == P and "'additionalProperties' to false" in error.message
    optional = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                "required": ["a"], "additionalProperties": False}
    check_schema(optional, P)
    error = refusal(optional, strict=True)
    assert error.param == f"{P}.required" and "'b' is not" in error.message
    nested = {"type": "object", "properties": {"o": {"type": ["object", "null"], "properties": {}}},
              "required": ["o"], "additionalProperties": False}
    assert refusal(nested, strict=True).param == f"{P}.properties.o"


def test_strict_mode_wants_an_object_at_the_root():
    check_schema({"type": "array", "items": {"type": "string"}}, P)
    assert "root schema must be of type 'object'" in refusal({"type": "array", "items": {}}, strict=True).message
    assert refusal({"anyOf": [{"type": "string"}]}, strict=True).param == P


def test_nesting_and_size_are_bounded():
    deep = leaf = {"type": "object", "properties": {}}
    for _ in range(MAX_DEPTH):
        leaf["properties"]["x"] = {"type": "object", "properties": {}}
        leaf = leaf["properties"]["x"]
    check_schema(deep, P)
    leaf["properties"]["x"] = {"type": "string"}
    assert "nest at most 10 levels" in refusal(deep).message
    chain = leaf = {}
    for _ in range(200):  # anyOf does not count as a level of values, but the walk is still bounded
        leaf["anyOf"] = [{}]
        leaf = leaf["anyOf"][0]
    assert "schemas may nest" in refusal(chain).message
    wide = {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {f"q{j}": {} for j in range(50)}}
                                             for i in range(MAX_PROPERTIES // 50)}}
    assert f"at most {MAX_PROPERTIES} properties" in refusal(wide).message
    assert "enum values" in refusal({"anyOf": [{"enum": list(range(600))}, {"enum": list(range(600))}]}).message

import dataclasses
import json
import subprocess
import sys

import pytest

from batchapi.grammar.spec import GrammarSpec


def test_json_schema_is_compact_so_equal_schemas_are_one_key():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    a = GrammarSpec.json_schema(schema)
    b = GrammarSpec.json_schema(json.loads(json.dumps(schema, indent=4)))
    assert a == b and hash(a) == hash(b)
    assert a.kind == "json_schema"
    assert a.schema == '{"type":"object","properties":{"b":{"type":"string"},"a":{"type":"integer"}}}'
    assert len({a, b, GrammarSpec.json_object()}) == 2


def test_property_order_is_kept_because_documents_follow_it():
    forward = GrammarSpec.json_schema({"properties": {"reasoning": {}, "answer": {}}})
    backward = GrammarSpec.json_schema({"properties": {"answer": {}, "reasoning": {}}})
    assert forward != backward


def test_json_object_has_no_schema_and_specs_are_frozen():
    spec = GrammarSpec.json_object()
    assert spec == GrammarSpec("json_object") and spec.schema == ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kind = "json_schema"


@pytest.mark.parametrize("kind, schema", [("regex", "a+"), ("json_schema", ""), ("json_object", '{"type":"object"}')])
def test_malformed_specs_are_refused(kind, schema):
    with pytest.raises(AssertionError):
        GrammarSpec(kind, schema)


def test_spec_module_is_plain_python():
    code = "import sys, batchapi.grammar.spec; print(sorted({'torch', 'llguidance'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

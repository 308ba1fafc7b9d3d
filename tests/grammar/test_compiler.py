import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from batchapi.grammar import CompiledGrammar, GrammarError, GrammarSpec, check_grammar
from tests.grammar.schemas import EXTRACTION, LABEL, SHAPES

BAD_SCHEMAS = [
    ({"type": "foo"}, "Invalid type: foo"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "'/\\$defs/missing' does not exist"),
    ({"type": "string", "pattern": "(?<=x)a"}, "look-around"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "not-a-format"}, "not-a-format"),
]


def test_a_shared_schema_compiles_once_under_concurrent_submits(compiler):
    specs = [GrammarSpec.json_schema(json.loads(json.dumps(LABEL))) for _ in range(32)]  # equal, not identical
    with ThreadPoolExecutor(16) as pool:
        futures = list(pool.map(compiler.submit, specs))
    grammars = {id(future.result(timeout=30)) for future in futures}
    assert len(grammars) == 1
    assert isinstance(futures[0].result(), CompiledGrammar)
    assert compiler.compiles == 1


def test_distinct_specs_compile_separately(compiler):
    specs = [GrammarSpec.json_schema(s) for s in (LABEL, EXTRACTION, SHAPES)] + [GrammarSpec.json_object()]
    grammars = [compiler.submit(spec).result(timeout=30) for spec in specs]
    assert len({id(g) for g in grammars}) == 4
    assert compiler.submit(specs[1]).result() is grammars[1]
    assert compiler.compiles == 4


def test_compiling_runs_on_a_background_thread(compiler):
    compiler.submit(GrammarSpec.json_schema(LABEL)).result(timeout=30)
    assert any(t.name.startswith("grammar-compile") for t in threading.enumerate())


@pytest.mark.parametrize("schema, message", BAD_SCHEMAS)
def test_a_refused_schema_fails_its_future_and_the_compiler_keeps_working(compiler, schema, message):
    bad = GrammarSpec.json_schema(schema)
    with pytest.raises(GrammarError, match=message):
        compiler.submit(bad).result(timeout=30)
    with pytest.raises(GrammarError, match=message):  # the refusal is cached, not recompiled
        compiler.submit(bad).result(timeout=30)
    assert compiler.compiles == 1
    grammar = compiler.submit(GrammarSpec.json_schema(LABEL)).result(timeout=30)
    assert not grammar.matcher().is_terminated
    assert compiler.compiles == 2


def test_a_schema_that_is_not_an_object_is_refused(compiler):
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        compiler.submit(GrammarSpec("json_schema", "[1,2]")).result(timeout=30)


@pytest.mark.parametrize("schema, message", BAD_SCHEMAS)
def test_check_grammar_refuses_without_a_tokenizer(schema, message):
    with pytest.raises(GrammarError, match=message):
        check_grammar(GrammarSpec.json_schema(schema))


@pytest.mark.parametrize("schema", [LABEL, EXTRACTION, SHAPES])
def test_check_grammar_accepts_the_strict_subset(schema):
    check_grammar(GrammarSpec.json_schema(schema))
    check_grammar(GrammarSpec.json_object())


def test_grammar_errors_are_value_errors_with_the_reason():
    with pytest.raises(ValueError) as info:
        check_grammar(GrammarSpec.json_schema({"type": "foo"}))
    assert str(info.value) == "unsupported JSON schema: Invalid type: foo"


def test_compiled_grammars_outlive_close(compiler):
    grammar = compiler.submit(GrammarSpec.json_object()).result(timeout=30)
    compiler.close()
    matcher = grammar.matcher()
    assert not matcher.is_terminated

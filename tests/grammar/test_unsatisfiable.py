"""Schemas that no document satisfies, or none short enough for the model: each a per-line 400
``invalid_json_schema`` at validation, naming where; and the engine's own failure with a grammar
(a token its mask allowed, refused) a 500 ``server_error`` with a log line, never the request's 400."""

from __future__ import annotations

import json
import logging

import pytest

from batchapi.engine import ErrorCode as EngineError
from batchapi.engine import GenerationResult
from batchapi.openai import render
from batchapi.openai.body import CHAT, MESSAGES, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.lines import InputLine
from batchapi.openai.message_results import result_line
from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter
from batchapi.workers.codec import Codec
from tests.grammar.test_size import MUTUAL, SELF
from tests.utils.batch_service import jsonl, request_line

M = "tiny-llama"
LONG = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{100000}$"}}, "required": ["s"]}


def chat_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def refusal(endpoint: str, body: dict) -> RequestError:
    with pytest.raises(RequestError) as refused:
        parse_body(endpoint, body)
    return refused.value


@pytest.mark.parametrize("schema,where", [(SELF, "properties.a"), (MUTUAL, "$defs.B.properties.a")])
def test_a_recursion_with_no_way_out_is_refused_where_it_closes(schema, where):
    error = refusal(CHAT, {"model": M, "messages": [{"role": "user", "content": "x"}],
                           "response_format": chat_format(schema)})
    assert (error.code, error.param) == (ErrorCode.INVALID_JSON_SCHEMA, f"response_format.json_schema.schema.{where}")
    assert "no finite JSON value satisfies the schema" in error.message
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    error = refusal(CHAT, {"model": M, "messages": [{"role": "user", "content": "x"}], "tools": [tool]})
    assert (error.code, error.param) == (ErrorCode.INVALID_JSON_SCHEMA, f"tools[0].function.parameters.{where}")
    error = refusal(MESSAGES, {"model": M, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                               "tools": [{"name": "f", "input_schema": schema}]})
    assert (error.code, error.param) == (ErrorCode.INVALID_JSON_SCHEMA, f"tools[0].input_schema.{where}")


@pytest.fixture(scope="module")
def counter(tiny_llama_dir) -> PromptCounter:
    return PromptCounter(tiny_llama_dir)


def scan(counter: PromptCounter, lines: list, endpoint: str):
    limits = Limits(endpoint=endpoint, served_model=M, model_aliases=frozenset({M}), max_lines=100, shard_size=4)
    return Scanner(limits, counter).scan([jsonl(lines)])


def test_validation_reports_each_unsatisfiable_schema_on_its_line(counter):
    lines = [request_line("ok", M, response_format=chat_format({"type": "object"})),
             request_line("self", M, response_format=chat_format(SELF)),
             request_line("mutual", M, response_format=chat_format(MUTUAL)),
             request_line("long", M, response_format=chat_format(LONG)),
             request_line("ok2", M, response_format=chat_format({"type": "object", "properties": {"a": {"$ref": "#"}}}))]
    result = scan(counter, lines, CHAT)
    assert result.errors == [] and result.request_count == 5
    schema = "body.response_format.json_schema.schema"
    assert [(e.code, e.line, e.param) for e in result.request_errors] == [
        ("invalid_json_schema", 2, f"{schema}.properties.a"), ("invalid_json_schema", 3, f"{schema}.$defs.B.properties.a"),
        ("invalid_json_schema", 4, schema)]
    context = counter.context_length * counter.max_token_bytes
    assert result.request_errors[2].message == (
        "no document of this schema fits the model's context: the shortest is at least 100008 bytes (most of them "
        f"at '#/properties/s'), and the context holds at most {context}")


def test_a_message_batch_s_output_config_schema_is_checked_the_same_way(counter):
    def line(custom_id: str, schema: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": MESSAGES,
                "body": {"model": M, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                         "output_config": {"format": {"type": "json_schema", "schema": schema}}}}

    result = scan(counter, [line("a", SELF), line("b", LONG), line("c", {"type": "object"})], MESSAGES)
    assert result.errors == [] and result.request_count == 3
    assert [(e.code, e.line, e.param) for e in result.request_errors] == [
        ("invalid_json_schema", 1, "body.output_config.format.schema.properties.a"),
        ("invalid_json_schema", 2, "body.output_config.format.schema")]


def test_the_engine_refusing_a_token_its_mask_allowed_is_a_500_server_error_and_a_log_line(tiny_llama_dir, caplog):
    body = {"model": M, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    for endpoint, payload in ((CHAT, {**request_line("c", M, response_format=chat_format({"type": "object"}))["body"]}),
                              (MESSAGES, body)):
        line = InputLine(line=1, custom_id="c", body=parse_body(endpoint, payload), error=None)
        result = GenerationResult("req-1", 4, 0, [], "the grammar refused token 17, which its mask allowed",
                                  EngineError.ENGINE_FAILURE)
        with caplog.at_level(logging.ERROR, logger="batchapi.workers.codec"):
            out, ok = Codec(tokenizer=None, model_id=M).line(line, result, ErrorCode.SERVER_ERROR)
        record = json.loads(out)
        assert not ok and record["response"]["status_code"] == 500
        assert record["response"]["body"]["error"] == {
            "message": "the grammar refused token 17, which its mask allowed", "type": "server_error", "param": None,
            "code": "server_error"}
        assert any("req-1" in r.getMessage() and "which its mask allowed" in r.getMessage() for r in caplog.records)
        caplog.clear()
        anthropic = json.loads(result_line(record))["result"]
        assert anthropic == {"type": "errored", "error": {"type": "error", "error": {
            "type": "api_error", "message": "the grammar refused token 17, which its mask allowed"}}}
    refused = json.loads(render.rejected("r", RequestError("bad", "temperature")))  # the request's own: still a 400
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["type"] == "invalid_request_error"

"""Anthropic's structured outputs on Message Batch requests: ``output_config.format`` with a JSON
schema goes the grammar path of chat's ``response_format`` json_schema, and the result is one text
block holding a document of the schema (run-batch on a tiny random model: the grammar holds the
output whatever the weights)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from batchapi.engine import EngineConfig, EngineFront
from batchapi.openai.body import CHAT, MESSAGES, parse_body
from batchapi.openai.errors import ErrorCode, RequestError
from batchapi.openai.message_results import result_line
from batchapi.openai.tools import grammar_spec
from batchapi.workers.run_batch import run_batch

CHOICE = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 3}},
          "required": ["answer", "n"], "additionalProperties": False}


def body(output_config, **extra) -> dict:
    return {"model": "m", "max_tokens": 48, "messages": [{"role": "user", "content": "Choose."}],
            "output_config": output_config, **extra}


def test_output_config_format_is_chat_s_json_schema_grammar():
    anthropic = parse_body(MESSAGES, body({"format": {"type": "json_schema", "schema": CHOICE}, "effort": "low"}))
    chat = parse_body(CHAT, {"model": "m", "messages": [{"role": "user", "content": "Choose."}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "choice", "schema": CHOICE}}})
    assert grammar_spec(anthropic) == grammar_spec(chat) is not None
    assert grammar_spec(parse_body(MESSAGES, body({}))) is None  # no format: free text


@pytest.mark.parametrize("output_config,param,code", [
    ({"format": {"type": "json_schema", "schema": CHOICE}, "verbosity": 1}, "output_config.verbosity",
     ErrorCode.UNKNOWN_PARAMETER),
    ({"format": {"type": "json_schema", "schema": CHOICE, "name": "x"}}, "output_config.format.name",
     ErrorCode.UNKNOWN_PARAMETER),
    ({"format": {"type": "text"}}, "output_config.format.type", ErrorCode.INVALID_VALUE),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema", ErrorCode.MISSING_REQUIRED_PARAMETER),
    ({"format": {"type": "json_schema", "schema": "{}"}}, "output_config.format.schema", ErrorCode.INVALID_TYPE),
    ({"format": {"type": "json_schema", "schema": {"type": "object", "oneOf": []}}}, "output_config.format.schema",
     ErrorCode.INVALID_JSON_SCHEMA),
    ({"format": "json"}, "output_config.format", ErrorCode.INVALID_TYPE),
    ({"effort": "extreme"}, "output_config.effort", ErrorCode.INVALID_VALUE),
    ("json", "output_config", ErrorCode.INVALID_TYPE),
])
def test_a_bad_output_config_is_refused_by_its_field(output_config, param, code):
    with pytest.raises(RequestError) as refused:
        parse_body(MESSAGES, body(output_config))
    assert (refused.value.param, refused.value.code) == (param, code)


@pytest.fixture(scope="module")
def front(tiny_llama_dir):
    front = EngineFront(EngineConfig(model_path=tiny_llama_dir, dtype="float32", kv_cache_bytes=8 << 20,
                                     max_num_seqs=4, max_model_len=512)).start()
    yield front
    front.shutdown()


def test_a_message_batch_line_with_output_config_answers_a_text_block_of_the_schema(tmp_path, front):
    lines = [{"custom_id": f"m{seed}", "method": "POST", "url": MESSAGES,
              "body": {**body({"format": {"type": "json_schema", "schema": CHOICE}}), "temperature": 1.0}}
             for seed in range(2)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    counts = run_batch(src, dst, front=front, progress=False)
    assert (counts.total, counts.completed) == (2, 2)
    for record in map(json.loads, dst.read_text().splitlines()):
        message = json.loads(result_line(record))["result"]["message"]
        assert message["stop_reason"] == "end_turn"
        [block] = message["content"]
        assert block["type"] == "text"
        jsonschema.validate(json.loads(block["text"]), CHOICE)

"""run-batch with structured outputs and tools, on a tiny random model: the grammar holds each
output to its schema whatever the weights, a forced tool call is parsed into tool_calls, a schema
the grammar engine refuses is that line's 400, and the output keeps input order."""

from __future__ import annotations

import json

import jsonschema
import pytest

from batchapi.engine import EngineConfig, EngineFront
from batchapi.workers.run_batch import run_batch

CHOICE = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["answer", "n"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
    "required": ["colour"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def front(tiny_llama_dir):
    front = EngineFront(EngineConfig(model_path=tiny_llama_dir, dtype="float32", kv_cache_bytes=8 << 20,
                                     max_num_seqs=4, max_model_len=512)).start()
    yield front
    front.shutdown()


def line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "Choose."}],
                                "temperature": 0.9, "seed": 7, "max_tokens": 64, **body}})


def test_run_batch_holds_outputs_to_their_schemas_in_input_order(tmp_path, front):
    schema_format = {"type": "json_schema", "json_schema": {"name": "choice", "schema": CHOICE, "strict": True}}
    refused = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    lines = [
        *[line(f"schema-{i}", response_format=schema_format, seed=i) for i in range(3)],
        line("tool", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "pick"}}),
        line("refused", response_format=refused),
        line("plain", max_tokens=3),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counts = run_batch(src, dst, front=front, progress=False, max_in_flight=2)
    records = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["schema-0", "schema-1", "schema-2", "tool", "refused", "plain"]
    assert (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    by_id = {r["custom_id"]: r["response"] for r in records}
    for i in range(3):
        choice = by_id[f"schema-{i}"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), CHOICE)
    tool = by_id["tool"]["body"]["choices"][0]
    assert tool["finish_reason"] == "tool_calls" and tool["message"]["content"] is None
    [call] = tool["message"]["tool_calls"]
    assert call["function"]["name"] == "pick"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL["function"]["parameters"])
    assert by_id["refused"]["status_code"] == 400
    assert by_id["refused"]["body"]["error"]["code"] == "invalid_json_schema"
    assert by_id["plain"]["body"]["system_fingerprint"].startswith("fp_")

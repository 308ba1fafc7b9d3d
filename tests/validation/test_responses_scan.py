"""Validation of /v1/responses files: the prompt counts are the worker's, and errors name the
Responses fields (the scanner, no database)."""

from __future__ import annotations

import pytest

from batchapi.openai.body import RESPONSES, parse_body
from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter, exact_counts
from batchapi.workers.codec import prompt_token_ids
from tests.utils.batch_service import jsonl

M = "tiny-llama"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
BODIES = [
    {"input": "Say hello."},
    {"input": "héllo 🤖 <|im_end|>", "instructions": "Be brief."},
    {"input": [{"role": "developer", "content": "Answer in French."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
               {"role": "user", "content": "Again"}]},
    {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required"},
    {"input": [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "18 C"}],
     "tools": [WEATHER], "instructions": "Use the tools."},
]


@pytest.fixture(scope="module")
def counter(tiny_llama_dir) -> PromptCounter:
    return PromptCounter(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": RESPONSES, "body": {"model": M, **body}}


def scan(counter, lines: list) -> object:
    limits = Limits(endpoint=RESPONSES, served_model=M, model_aliases=frozenset({M}), max_lines=100, shard_size=2)
    return Scanner(limits, counter).scan([jsonl(lines)])


def test_prompt_counts_are_the_workers_prompt_tokens(counter, hf_tokenizer):
    parsed = [parse_body(RESPONSES, {"model": M, **body}) for body in BODIES]
    assert exact_counts(counter, parsed) == [len(prompt_token_ids(p, hf_tokenizer)) for p in parsed]


def test_body_and_context_problems_name_the_responses_fields(counter):
    lines = [line(f"r{i}", **body) for i, body in enumerate(BODIES)]
    lines += [line("web", input="x", tools=[{"type": "web_search"}]),
              line("chained", input="x", previous_response_id="resp_1"),
              line("seed", input="x", seed=1),
              line("long", input="hello " * 600),
              line("too-much", input="x", max_output_tokens=600)]
    result = scan(counter, lines)
    assert [(e.code, e.line, e.param) for e in result.errors] == [
        ("context_length_exceeded", 9, "body.input"), ("context_length_exceeded", 10, "body.max_output_tokens")]
    assert [(e.code, e.line, e.param) for e in result.request_errors] == [
        ("invalid_value", 6, "body.tools[0].type"), ("invalid_value", 7, "body.previous_response_id"),
        ("unknown_parameter", 8, "body.seed")]
    assert "max_output_tokens (600)" in result.errors[1].message


def test_a_good_responses_file_is_bounded_by_its_prompts_and_max_output_tokens(counter, hf_tokenizer):
    lines = [line(f"r{i}", max_output_tokens=5, **body) for i, body in enumerate(BODIES)]
    result = scan(counter, lines)
    assert result.errors == [] and result.request_errors == [] and result.request_count == len(BODIES)
    parsed = [parse_body(RESPONSES, x["body"]) for x in lines]
    assert result.prompt_tokens >= sum(len(prompt_token_ids(p, hf_tokenizer)) for p in parsed)  # bytes bound it
    assert result.max_output_tokens == 5 * len(BODIES)

"""Validation of completions bodies of several prompts and of echo scoring: every prompt counts, each
must fit the context, and ``max_tokens: 0`` may score a prompt of the whole context."""

from __future__ import annotations

from transformers import AutoTokenizer

from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter
from tests.utils.batch_service import jsonl

M = "m"
COMPLETIONS = "/v1/completions"


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": {"model": M, **body}}


def scan(counter, lines):
    limits = Limits(endpoint=COMPLETIONS, served_model=M, model_aliases=frozenset({M}), max_lines=100, shard_size=8)
    return Scanner(limits, counter).scan([jsonl(lines)])


def test_every_prompt_counts_and_each_must_fit(tiny_llama_dir):
    counter = PromptCounter(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = ["The sky is", "Grass is usually"]
    result = scan(counter, [line("many", prompt=texts, max_tokens=2), line("ids", prompt=[[5, 6, 7], [8]], max_tokens=1)])
    assert not result.errors and not result.request_errors
    assert result.prompt_tokens >= sum(len(tokenizer.encode(t)) for t in texts) + 4  # text: a bound from bytes
    assert result.max_output_tokens == 2 * 2 + 1 * 2  # max_tokens for each prompt
    assert scan(counter, [line("ids", prompt=[[5, 6, 7], [8]], max_tokens=1)]).prompt_tokens == 4  # ids: exact
    context = counter.context_length
    result = scan(counter, [line("long", prompt=[[5] * 10, [5] * context], max_tokens=1)])
    assert [(e.code, e.line) for e in result.errors] == [("context_length_exceeded", 1)]


def test_echo_may_score_the_whole_context(tiny_llama_dir):
    counter = PromptCounter(tiny_llama_dir)
    context = counter.context_length
    result = scan(counter, [line("whole", prompt=[5] * context, echo=True, logprobs=1, max_tokens=0)])
    assert not result.errors and result.prompt_tokens == context and result.max_output_tokens == 0
    result = scan(counter, [line("over", prompt=[5] * context, echo=True, logprobs=1, max_tokens=1)])
    assert [e.code for e in result.errors] == ["context_length_exceeded"]

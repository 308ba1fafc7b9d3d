"""Validation of reasoning requests: thinking asked of a model that cannot think, and a forged
thinking block, are those lines' 400s; the prompt counts of a thinking template follow its switch
exactly as the worker's tokenizer renders it."""

from __future__ import annotations

from transformers import AutoTokenizer

from batchapi.openai.body import CHAT, MESSAGES, parse_body
from batchapi.openai.reasoning import sign
from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter, exact_counts
from batchapi.workers.codec import prompt_token_ids, thinking_template
from tests.utils.batch_service import jsonl, request_line

M = "m"
KEY = b"validation-key"


def scan(counter, lines, endpoint=CHAT):
    limits = Limits(endpoint=endpoint, served_model=M, model_aliases=frozenset({M}), max_lines=100, shard_size=4,
                    thinking_key=KEY)
    return Scanner(limits, counter).scan([jsonl(lines)])


def test_thinking_on_a_model_that_cannot_think_fails_that_line_alone(tiny_llama_dir):
    result = scan(PromptCounter(tiny_llama_dir), [
        request_line("a", M), request_line("b", M, reasoning_effort="low"), request_line("c", M, reasoning_effort="none")])
    assert not result.errors and result.request_count == 3
    assert [(e.line, e.code, e.param) for e in result.request_errors] == [(2, "invalid_value", "body.reasoning_effort")]


def test_a_forged_thinking_block_fails_that_request(tiny_thinking_dir):
    def request(custom_id, signature):
        return {"custom_id": custom_id, "params": {"model": M, "max_tokens": 32, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": signature},
                                              {"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": "Again"}]}}

    lines = [{"custom_id": r["custom_id"], "method": "POST", "url": MESSAGES, "body": r["params"]}
             for r in (request("good", sign("Greet back.", KEY)), request("forged", sign("Greet back.", b"other")))]
    result = scan(PromptCounter(tiny_thinking_dir), lines, MESSAGES)
    assert [(e.line, e.param) for e in result.request_errors] == [(2, "body.messages[1].content[0].signature")]


def test_prompt_counts_follow_the_thinking_switch(tiny_thinking_dir):
    counter = PromptCounter(tiny_thinking_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_thinking_dir)
    template = thinking_template(tokenizer)
    assert template == counter.thinking and template is not None
    bodies = [parse_body(CHAT, {"model": M, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
                                **extra}) for extra in ({}, {"reasoning_effort": "none"}, {"reasoning_effort": "high"})]
    counts = exact_counts(counter, bodies)
    assert counts == [len(prompt_token_ids(b, tokenizer, template)) for b in bodies]
    assert counts[1] > counts[0] == counts[2]  # off closes an empty block after the generation prompt

"""Every validation rule, with the line numbers it reports (the scanner, no database)."""

from __future__ import annotations

import json

import pytest

from batchapi.openai.body import parse_body
from batchapi.openai.lines import iter_lines
from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter, exact_counts
from tests.utils.batch_service import CHAT, jsonl, request_line

M = "tiny-llama"


@pytest.fixture(scope="module")
def counter(tiny_llama_dir) -> PromptCounter:
    return PromptCounter(tiny_llama_dir)


def scan(counter, data: bytes, endpoint: str = CHAT, max_lines: int = 1000, shard_size: int = 2, chunk: int = 7):
    limits = Limits(endpoint=endpoint, served_model=M, model_aliases=frozenset({M, "/models/tiny-llama"}),
                    max_lines=max_lines, shard_size=shard_size)
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]  # lines cut across chunks
    return Scanner(limits, counter).scan(chunks)


def codes(result) -> list[tuple[str, int | None]]:
    return [(e.code, e.line) for e in result.errors]


def ok(i: int, **body) -> dict:
    return request_line(f"r{i}", M, **body)


CASES = {
    "not json": ([ok(1), "{not json", ok(3)], [("invalid_json_line", 2)]),
    "not an object": ([ok(1), ok(2), "[1, 2]", '"text"'], [("invalid_json_line", 3), ("invalid_json_line", 4)]),
    "missing custom_id": ([{k: v for k, v in ok(1).items() if k != "custom_id"}], [("missing_custom_id", 1)]),
    "empty custom_id": ([ok(1), {**ok(2), "custom_id": ""}], [("missing_custom_id", 2)]),
    "custom_id not a string": ([{**ok(1), "custom_id": 7}], [("missing_custom_id", 1)]),
    "duplicate custom_id": ([ok(1), ok(2), ok(1), ok(2)], [("duplicate_custom_id", 3), ("duplicate_custom_id", 4)]),
    "method not POST": ([ok(1), {**ok(2), "method": "GET"}], [("invalid_method", 2)]),
    "url not the endpoint": ([{**ok(1), "url": "/v1/completions"}, ok(2)], [("invalid_url", 1)]),
    "unknown model": ([request_line("a", "gpt-4o")], [("model_not_found", 1)]),
    "more than one model": ([ok(1), ok(2), request_line("x", "gpt-4o")], [("mismatched_model", 3)]),
    "no messages": ([{**ok(1), "body": {"model": M}}], [("missing_required_parameter", 1)]),
    "bad role": ([ok(1), ok(2, messages=[{"role": "wizard", "content": "x"}])], [("invalid_value", 2)]),
    "max_tokens out of range": ([ok(1, max_tokens=0)], [("invalid_value", 1)]),
    "n below 1": ([ok(1), ok(2), ok(3, n=0)], [("invalid_value", 3)]),
    "sampling field of the wrong type": ([ok(1, temperature="hot")], [("invalid_type", 1)]),
    "unknown field": ([ok(1, frobnicate=1)], [("unknown_parameter", 1)]),
    "body not an object": ([{**ok(1), "body": []}], [("invalid_type", 1)]),
    "prompt longer than the context": ([ok(1), ok(2, content="hello " * 600)], [("context_length_exceeded", 2)]),
    "prompt plus max_tokens over the context": ([ok(1, max_tokens=500)], [("context_length_exceeded", 1)]),
    "not UTF-8": ([ok(1), b'{"custom_id": "\xff\xfe"}'], [("invalid_encoding", 2)]),
    "only blank lines": (["", "  "], [("empty_file", None)]),
}


@pytest.mark.parametrize("lines,expected", CASES.values(), ids=list(CASES))
def test_each_rule_reports_its_line(counter, lines, expected):
    result = scan(counter, jsonl(lines))
    assert codes(result) == expected
    assert result.shards == []


def test_errors_name_the_param(counter):
    result = scan(counter, jsonl([ok(1, temperature="hot"), {**ok(2), "url": "/x"}, request_line("r3", "gpt")]))
    assert [e.param for e in result.errors] == ["body.temperature", "url", "body.model"]
    assert all(e.message for e in result.errors)


def test_too_many_lines(counter):
    result = scan(counter, jsonl([ok(i) for i in range(1, 6)]), max_lines=3)
    assert codes(result) == [("too_many_lines", 4)]


def hf_chat_count(tok, messages) -> int:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_valid_file_is_sharded_by_byte_ranges(counter, hf_tokenizer):
    lines = [ok(1), ok(2, content="longer " * 20, max_tokens=10), "", ok(4, n=2, max_tokens=5), ok(5)]
    data = jsonl(lines)
    result = scan(counter, data, shard_size=2)
    assert result.errors == []
    assert result.request_count == 4
    assert [(s.first_line, s.last_line, s.request_count) for s in result.shards] == [(1, 2, 2), (4, 5, 2)]
    for shard, expected in zip(result.shards, [[1, 2], [4, 5]], strict=True):
        chunk = data[shard.start_byte : shard.end_byte]
        ids = [json.loads(x)["custom_id"] for x in chunk.splitlines() if x.strip()]
        assert ids == [f"r{i}" for i in expected]
    exact = [hf_chat_count(hf_tokenizer, lines[i - 1]["body"]["messages"]) for i in (1, 2, 4, 5)]
    # validation records an upper bound; the exact counts come from the counting pass
    assert result.prompt_tokens >= sum(exact)
    assert result.shards[0].estimated_output_tokens == (counter.context_length - 1) + 10
    assert result.shards[1].estimated_output_tokens == 2 * 5 + (counter.context_length - 1)


def test_exact_counts_match_transformers(counter, hf_tokenizer):
    chats = [ok(1), ok(2, content="longer " * 20), ok(3, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🤖 <|im_end|>"}])]
    parsed = [parse_body(CHAT, line["body"]) for line in chats]
    assert exact_counts(counter, parsed) == [hf_chat_count(hf_tokenizer, line["body"]["messages"]) for line in chats]
    prompts = ["Once upon a time", [1, 2, 3, 4, 5], "héllo wörld"]
    parsed = [parse_body("/v1/completions", {"model": M, "prompt": p}) for p in prompts]
    assert exact_counts(counter, parsed) == [
        len(hf_tokenizer("Once upon a time")["input_ids"]), 5, len(hf_tokenizer("héllo wörld")["input_ids"])]


@pytest.mark.parametrize("text", ["", "a", "hello world " * 50, "🤖" * 40, "日本語のテキスト" * 30, "<|im_start|>" * 20,
                                  "\n\t  \r " * 30, "x" * 1000])
def test_byte_bound_is_never_below_the_count(counter, text):
    for add in (False, True):
        assert counter.upper_bound(text, add) >= counter.count_texts([text], add_special_tokens=add)[0]


def test_prompt_with_many_bytes_but_few_tokens_fits(counter):
    # 600 bytes is over the 512-token context, so this one is tokenized exactly: ~100 tokens
    result = scan(counter, jsonl([ok(1, content="hello " * 100)]))
    assert result.errors == [] and result.request_count == 1


def test_multi_message_templates_match_transformers(counter, hf_tokenizer):
    tok = hf_tokenizer
    conversations = [
        [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Hi <|im_end|>"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
        [{"role": "user", "content": ""}],
    ]
    for messages in conversations * 2:  # the second round uses the cached template pieces
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert counter.render_chat(messages) == text
        assert counter.count_texts([counter.render_chat(messages)], add_special_tokens=False) == [len(tok(text, add_special_tokens=False)["input_ids"])]


def test_error_reports_are_capped(counter):
    result = scan(counter, jsonl(["nope"] * 500))
    assert len(result.errors) == 100
    assert result.errors[-1].line == 100


def test_iter_lines_keeps_byte_offsets():
    data = b'a\n\nbcd\r\nlast'
    got = list(iter_lines([data[:3], data[3:5], data[5:]]))
    assert got == [(1, 0, 2, b"a"), (2, 2, 3, b""), (3, 3, 8, b"bcd\r"), (4, 8, 12, b"last")]


def test_progress_reports_the_estimate_so_far_and_can_stop_the_scan(counter):
    data = jsonl([ok(i, max_tokens=3) for i in range(1, 9001)])
    seen = []

    def progress(scanner):
        seen.append((len(scanner.done), scanner.output_tokens, scanner.prompt_tokens > 0))
        return len(seen) < 2

    limits = Limits(endpoint=CHAT, served_model=M, model_aliases=frozenset({M}), max_lines=50_000, shard_size=256)
    result = Scanner(limits, counter).scan([data[i : i + 65536] for i in range(0, len(data), 65536)], progress)
    assert seen == [(4096, 4096 * 3, True), (8192, 8192 * 3, True)]
    assert result.request_count == 8192  # stopped at the second report


def test_error_messages_stay_short_when_the_input_is_huge(counter):
    result = scan(counter, jsonl([request_line("a", "m" * 100_000), {**ok(2), "method": "G" * 100_000}]))
    assert [(e.code, e.line) for e in result.errors] == [("model_not_found", 1), ("invalid_method", 2)]
    assert all(len(e.message) <= 300 for e in result.errors)

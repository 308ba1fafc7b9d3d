"""Every validation rule, with the line numbers it reports (the scanner, no database)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchapi.openai.body import MESSAGES, parse_body
from batchapi.openai.lines import iter_lines
from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter, exact_counts
from tests.utils.batch_service import CHAT, jsonl, request_line

M = "tiny-llama"


@pytest.fixture(scope="module")
def counter(tiny_llama_dir) -> PromptCounter:
    return PromptCounter(tiny_llama_dir)


def scan(counter, data: bytes, endpoint: str = CHAT, max_lines: int = 1000, shard_size: int = 2, chunk: int = 7,
         max_line_bytes: int | None = None):
    limits = Limits(endpoint=endpoint, served_model=M, model_aliases=frozenset({M, "/models/tiny-llama"}),
                    max_lines=max_lines, shard_size=shard_size, max_line_bytes=max_line_bytes)
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
    "unknown model in a refused body": ([request_line("x", "gpt-4o", frobnicate=1)], [("model_not_found", 1)]),
    "another model in a refused body": ([ok(1), request_line("x", "gpt-4o", n=0)], [("mismatched_model", 2)]),
    "refused body with a duplicate custom_id": ([ok(1), ok(1, n=0)], [("duplicate_custom_id", 2)]),
    "prompt longer than the context": ([ok(1), ok(2, content="hello " * 600)], [("context_length_exceeded", 2)]),
    "prompt plus max_tokens over the context": ([ok(1, max_tokens=500)], [("context_length_exceeded", 1)]),
    "not UTF-8": ([ok(1), b'{"custom_id": "\xff\xfe"}'], [("invalid_encoding", 2)]),
    "lone surrogate in custom_id": ([ok(1), {**ok(2), "custom_id": "r\ud800"}], [("invalid_encoding", 2)]),
    "lone surrogate in content": ([ok(1), ok(2), ok(3, content="hi \udfff")], [("invalid_encoding", 3)]),
    "nested 100,000 deep": ([ok(1), '{"custom_id": "x", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"],
                            [("invalid_json_line", 2)]),
    "only blank lines": (["", "  "], [("empty_file", None)]),
}


@pytest.mark.parametrize("lines,expected", CASES.values(), ids=list(CASES))
def test_each_rule_reports_its_line(counter, lines, expected):
    result = scan(counter, jsonl(lines))
    assert codes(result) == expected
    assert result.shards == []


# a problem inside one body: that request alone is refused (a 400 when it runs), the batch runs
REQUEST_CASES = {
    "no messages": ([{**ok(1), "body": {"model": M}}], [("missing_required_parameter", 1, "body.messages")]),
    "bad role": ([ok(1), ok(2, messages=[{"role": "wizard", "content": "x"}])],
                 [("invalid_value", 2, "body.messages[0].role")]),
    "max_tokens out of range": ([ok(1, max_tokens=0)], [("invalid_value", 1, "body.max_tokens")]),
    "n below 1": ([ok(1), ok(2), ok(3, n=0)], [("invalid_value", 3, "body.n")]),
    "sampling field of the wrong type": ([ok(1, temperature="hot")], [("invalid_type", 1, "body.temperature")]),
    "unknown field": ([ok(1), ok(2, frobnicate=1), ok(3)], [("unknown_parameter", 2, "body.frobnicate")]),
    "body not an object": ([{**ok(1), "body": []}, ok(2)], [("invalid_type", 1, "body")]),
    "no body": ([{k: v for k, v in ok(1).items() if k != "body"}], [("invalid_type", 1, "body")]),
    "no model": ([ok(1), {**ok(2), "body": {"messages": []}}], [("missing_required_parameter", 2, "body.model")]),
    "model by its alias": ([request_line("a", "/models/tiny-llama", n=0), ok(2)], [("invalid_value", 1, "body.n")]),
}


def request_codes(result) -> list[tuple[str, int, str]]:
    return [(e.code, e.line, e.param) for e in result.request_errors]


@pytest.mark.parametrize("lines,expected", REQUEST_CASES.values(), ids=list(REQUEST_CASES))
def test_a_body_problem_refuses_that_request_only(counter, lines, expected):
    result = scan(counter, jsonl(lines))
    assert result.errors == [] and request_codes(result) == expected
    assert result.request_error_total == len(expected)
    assert result.request_count == len(lines)  # the refused requests are requests: each ends as a 400 line
    assert sum(s.request_count for s in result.shards) == len(lines)
    assert result.model == M
    refused = {line for _, line, _ in expected}
    rest = scan(counter, jsonl(line for i, line in enumerate(lines, 1) if i not in refused))
    assert (result.prompt_tokens, result.max_output_tokens) == (rest.prompt_tokens, rest.max_output_tokens)
    assert all(e.message for e in result.request_errors)


def test_a_file_whose_every_body_is_refused_still_runs(counter):
    result = scan(counter, jsonl([ok(i, frobnicate=i) for i in range(1, 6)]), shard_size=2)
    assert result.errors == [] and result.request_error_total == 5
    assert [(s.first_line, s.last_line, s.request_count) for s in result.shards] == [(1, 2, 2), (3, 4, 2), (5, 5, 1)]
    assert (result.request_count, result.prompt_tokens, result.max_output_tokens) == (5, 0, 0)
    assert all((s.prompt_tokens, s.estimated_output_tokens) == (0, 0) for s in result.shards)


def test_request_error_reports_are_capped_and_counted(counter):
    result = scan(counter, jsonl([ok(i, n=0) for i in range(1, 151)]), chunk=1 << 16)
    report = result.request_report
    assert report["object"] == "list" and report["total"] == 150 and result.request_count == 150
    assert [e["line"] for e in report["data"]] == list(range(1, 101))
    assert report["data"][0] == {"code": "invalid_value", "message": "'n' must be between 1 and 128, got 0",
                                 "param": "body.n", "line": 1}
    assert scan(counter, jsonl([ok(1)])).request_report is None


def test_a_file_problem_fails_the_batch_and_body_problems_are_still_listed(counter):
    result = scan(counter, jsonl([ok(1, frobnicate=1), "{oops", ok(3), ok(4, temperature=9)]))
    assert codes(result) == [("invalid_json_line", 2)] and result.shards == []
    assert request_codes(result) == [("unknown_parameter", 1, "body.frobnicate"), ("invalid_value", 4, "body.temperature")]


def test_errors_name_the_param(counter):
    result = scan(counter, jsonl([ok(1, temperature="hot"), {**ok(2), "url": "/x"}, request_line("r3", "gpt")]))
    assert [e.param for e in result.errors] == ["url", "body.model"]
    assert [e.param for e in result.request_errors] == ["body.temperature"]
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
                                  "\n\t  \r " * 30, "x" * 1000, " " * 5000, "\n" * 3000, "=" * 4000])
def test_byte_bound_is_never_below_the_count(counter, text):
    for add in (False, True):
        count = counter.count_texts([text], add_special_tokens=add)[0]
        assert counter.lower_bound(text) <= count <= counter.upper_bound(text, add)


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


def test_surrogate_and_nesting_errors_name_their_field(counter):
    result = scan(counter, jsonl([{**ok(1), "custom_id": "\ud800"}, ok(2, content="\udfff"),
                                  '{"custom_id": "x", "body": ' + "{\"a\": " * 5000 + "1" + "}" * 5000 + "}"]))
    assert [(e.code, e.line, e.param) for e in result.errors] == [
        ("invalid_encoding", 1, "custom_id"), ("invalid_encoding", 2, "body.messages[0].content"),
        ("invalid_json_line", 3, None)]
    assert "lone UTF-16 surrogate" in result.errors[0].message
    assert result.errors[2].message == "the line's JSON is nested too deeply to read"


def test_a_line_over_the_limit_is_line_too_long_and_the_rest_is_checked(counter):
    big = ok(2, content="x" * 5000)
    result = scan(counter, jsonl([ok(1), big, ok(3), {**ok(4), "method": "GET"}]), max_line_bytes=1024)
    size = len(json.dumps(big))
    assert [(e.code, e.line, e.param) for e in result.errors] == [("line_too_long", 2, None), ("invalid_method", 4, "method")]
    assert result.errors[0].message == f"the line is {size} bytes; the limit is 1024 bytes per line"
    ok_result = scan(counter, jsonl([ok(1), ok(3)]), max_line_bytes=1024, shard_size=1)
    assert ok_result.errors == [] and [s.request_count for s in ok_result.shards] == [1, 1]


MEMORY_PROBE = """
    import resource, sys
    from batchapi.validation.scanner import Limits, Scanner
    from batchapi.validation.token_counts import PromptCounter

    size, limit = int(sys.argv[2]), int(sys.argv[3])
    counter = PromptCounter(sys.argv[1])
    head = b'{"custom_id": "big", "method": "POST", "url": "/v1/chat/completions", ' \\
           b'"body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "'
    tail = b'"}]}}\\n'
    good = b'{"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", ' \\
           b'"body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}]}}\\n'

    def chunks():  # one line of ``size`` bytes, streamed in 1 MiB chunks as storage does, then a good line
        yield head
        for _ in range((size - len(head) - len(tail)) // 2**20):
            yield b"hello world " * (2**20 // 12) + b"hello"[: 2**20 % 12]
        yield tail + good

    limits = Limits(endpoint="/v1/chat/completions", served_model="tiny-llama", model_aliases=frozenset({"tiny-llama"}),
                    max_lines=100, shard_size=8, max_line_bytes=limit)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = Scanner(limits, counter).scan(chunks())
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(growth // 1024, *[f"{e.code}:{e.line}" for e in result.errors])
"""


def peak_growth_mb(model_dir: Path, size: int, limit: int) -> tuple[int, list[str]]:
    """The scan of a file holding one ``size``-byte line, in a fresh process: its peak RSS growth
    (MB) and its errors."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEMORY_PROBE), str(model_dir), str(size), str(limit)],
        check=True, capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=300,
    ).stdout.split()
    return int(out[0]), out[1:]


def test_one_huge_line_costs_no_memory(tiny_llama_dir):
    growth, errors = peak_growth_mb(tiny_llama_dir, 30 * 2**20, 4 * 2**20)
    assert errors == ["line_too_long:1"]
    assert growth < 50, f"scanning a 30 MB line grew the peak RSS by {growth} MB"


def test_one_line_at_the_limit_is_refused_untokenized(tiny_llama_dir):
    growth, errors = peak_growth_mb(tiny_llama_dir, 4 * 2**20 - 4096, 4 * 2**20)
    assert errors == ["context_length_exceeded:1"]
    assert growth < 50, f"scanning a 4 MB prompt grew the peak RSS by {growth} MB"


def test_a_prompt_that_surely_cannot_fit_is_reported_by_its_floor(counter):
    text = "hello " * 8000  # 48,000 bytes: at least 592 tokens of at most 81 bytes, over the 512 context
    assert counter.max_token_bytes == 81 and counter.lower_bound(text) == 592
    result = scan(counter, jsonl([ok(1), ok(2, content=text)]), chunk=4096)
    assert [(e.code, e.line, e.param) for e in result.errors] == [("context_length_exceeded", 2, "body.messages")]
    floor = counter.lower_bound(counter.render_chat([{"role": "user", "content": text}]))
    assert result.errors[0].message == f"the prompt is at least {floor} tokens; the model's context is 512 tokens"


def message_line(i: int, model: str = M, content: str = "hello", max_tokens: int = 16, **params) -> dict:
    return {"custom_id": f"m{i}", "method": "POST", "url": MESSAGES,
            "body": {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}],
                     **params}}


def test_a_message_batch_refuses_a_request_for_its_model_or_context_alone(counter):
    """Anthropic validates each request of a Message Batch on its own: the model and the context
    are the request's concern, where OpenAI's rule fails the file (CASES above)."""
    lines = [message_line(1), message_line(2, model="claude-x"), message_line(3, content="hello " * 600),
             message_line(4, max_tokens=500), message_line(5, model="/models/tiny-llama"),
             message_line(6, model="claude-x", temperature=9)]
    result = scan(counter, jsonl(lines), endpoint=MESSAGES)
    assert result.errors == []
    assert request_codes(result) == [("model_not_found", 2, "body.model"),
                                     ("context_length_exceeded", 3, "body.messages"),
                                     ("context_length_exceeded", 4, "body.max_tokens"),
                                     ("invalid_value", 6, "body.temperature")]  # one error a request
    assert result.request_count == 6 and sum(s.request_count for s in result.shards) == 6
    rest = scan(counter, jsonl([message_line(1), message_line(5)]), endpoint=MESSAGES)
    assert (result.prompt_tokens, result.max_output_tokens) == (rest.prompt_tokens, rest.max_output_tokens) != (0, 0)
    assert "'claude-x' is not served for this batch" in result.request_errors[0].message

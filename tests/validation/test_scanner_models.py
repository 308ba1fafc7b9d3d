"""A Message Batch whose requests name several served models: each request checked against its own
model (its names, its context), the shards cut per model with their own lines, the estimate per
model (the scanner, no database)."""

from __future__ import annotations

import json
import shutil

import pytest

from batchapi.openai.body import MESSAGES
from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter
from tests.utils.batch_service import jsonl

A, B = "model-a", "model-b"
LONG = "hello " * 600  # past A's 512 tokens, within B's 4096


@pytest.fixture(scope="module")
def counters(tiny_llama_dir, tmp_path_factory) -> dict[str, PromptCounter]:
    """A: the tiny model; B: its tokenizer with a context eight times as long (a counter reads no weights)."""
    wide = tmp_path_factory.mktemp("model-b")
    for path in tiny_llama_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, wide / path.name)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return {A: PromptCounter(tiny_llama_dir), B: PromptCounter(wide)}


def line(i: int, model: str, content: str = "hello", max_tokens: int = 16) -> dict:
    return {"custom_id": f"m{i}", "method": "POST", "url": MESSAGES,
            "body": {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}}


def scan(counters, lines: list[dict], shard_size: int = 2):
    limits = Limits(endpoint=MESSAGES, served_model=A, model_aliases=frozenset({A, "/models/a"}), max_lines=100,
                    shard_size=shard_size, more_models={B: frozenset({B, "/models/b"})})
    return Scanner(limits, counters[A], {B: counters[B]}).scan([jsonl(lines)])


def test_each_request_is_checked_against_its_own_model_and_sharded_by_it(counters):
    lines = [line(1, A), line(2, B), line(3, "/models/b", LONG), line(4, A, LONG), line(5, "claude-x"),
             line(6, "/models/a"), line(7, B)]
    result = scan(counters, lines)
    assert result.errors == []
    assert [(e.code, e.line) for e in result.request_errors] == [("context_length_exceeded", 4),
                                                                 ("model_not_found", 5)]
    assert "run on 'model-a' or 'model-b'" in result.request_errors[1].message
    # A's: its own requests, the one too long for it and the unknown model's; B's: its three
    assert [(s.model, s.lines, s.request_count) for s in result.shards] == [
        (A, [1, 4], 2), (A, [5, 6], 2), (B, [2, 3], 2), (B, [7], 1)]
    assert [(s.first_line, s.last_line) for s in result.shards] == [(1, 4), (5, 6), (2, 3), (7, 7)]
    long_b = scan(counters, [line(3, B, LONG)]).prompt_tokens
    short = scan(counters, [line(1, A)]).prompt_tokens
    assert long_b > 512 > short > 0  # counted on B's context, which it fits
    estimates = result.estimates()
    assert estimates[A][0] == 2 * short and estimates[B][0] == 2 * short + long_b
    assert (result.prompt_tokens, result.request_count) == (estimates[A][0] + estimates[B][0], 7)


def test_requests_of_one_model_keep_contiguous_shards(counters):
    result = scan(counters, [line(1, B), line(2, "/models/b"), line(3, B)])
    assert [(s.model, s.lines, s.first_line, s.last_line) for s in result.shards] == [(B, None, 1, 2), (B, None, 3, 3)]

"""Thinking blocks in the engine, on a tiny random Qwen3 model with ``<think>`` tokens: the opening
marker forced first, the budget counted and the closing marker forced at it, a block the model
closes itself, a grammar that applies only after the block, stop strings searched only in the
answer, n > 1 forks thinking each on their own, and a prompt that already opened the block."""

from __future__ import annotations

import json

import jsonschema
from transformers import AutoTokenizer

from batchapi.engine import GenerationRequest, SamplingParams
from batchapi.engine.thinking import Thinking
from batchapi.grammar import GrammarSpec
from tests.engine.test_engine import engine_for
from tests.engine.test_structured import ENUM, run


def markers(model_dir) -> tuple[AutoTokenizer, int, int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    [start], [end] = tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)
    return tok, start, end


def prompt(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_the_budget_is_enforced_and_the_block_is_counted(tiny_thinking_dir):
    tok, start, end = markers(tiny_thinking_dir)
    engine = engine_for(tiny_thinking_dir)
    results = run(engine, [GenerationRequest(f"r{b}", prompt(tok, "Why?"), SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True, thinking=Thinking((start,), (end,), budget=b)))
        for b in (0, 5, 9)] + [GenerationRequest("plain", prompt(tok, "Why?"), SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True))])
    for budget in (0, 5, 9):
        out = results[f"r{budget}"].outputs[0]
        assert out.token_ids[0] == start and out.token_ids[budget + 1] == end, out.token_ids
        assert end not in out.token_ids[1: budget + 1]  # the model did not close it sooner
        assert out.thinking_tokens == budget + 2 and len(out.token_ids) == 20
        assert out.thinking_text == tok.decode(out.token_ids[: budget + 2])
        assert out.text == tok.decode(out.token_ids[budget + 2:])  # the answer alone
    plain = results["plain"].outputs[0]
    assert plain.thinking_tokens == 0 and start not in plain.token_ids[:1]
    # the forced tokens do not disturb the model: the thinking of budget 5 is the first 5 of budget 9
    assert results["r5"].outputs[0].token_ids[:6] == results["r9"].outputs[0].token_ids[:6]


def test_a_block_the_model_closes_itself_ends_there(tiny_thinking_dir):
    tok, start, end = markers(tiny_thinking_dir)
    engine = engine_for(tiny_thinking_dir)
    # a bias towards the closing marker: the model closes the block at its first free token
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={end: 100.0}, logprobs=True,
                            thinking=Thinking((start,), (end,), budget=50))
    out = run(engine, [GenerationRequest("r", prompt(tok, "Hi"), params)])["r"].outputs[0]
    assert out.token_ids[:2] == [start, end] and out.thinking_tokens == 2
    assert out.logprobs[0].token_id == start and out.logprobs[0].logprob < 0  # the model's own logprob of it
    assert end in out.token_ids[2:]  # the bias goes on; after the block it is answer text
    assert out.text == tok.decode(out.token_ids[2:])


def test_the_grammar_applies_after_the_block(tiny_thinking_dir):
    tok, start, end = markers(tiny_thinking_dir)
    engine = engine_for(tiny_thinking_dir)
    spec = GrammarSpec.json_schema(ENUM)
    results = run(engine, [GenerationRequest(f"r{i}", prompt(tok, text), SamplingParams(
        max_tokens=80, temperature=t, seed=i, n=2, grammar=spec, thinking=Thinking((start,), (end,), budget=6)))
        for i, (text, t) in enumerate([("Is it?", 0.0), ("Maybe so.", 1.0)])])
    for result in results.values():
        assert result.error is None and len(result.outputs) == 2
        for out in result.outputs:  # each fork thinks, then answers in the schema
            assert out.finish_reason == "stop" and out.thinking_tokens == 8, out
            assert out.token_ids[0] == start and out.token_ids[7] == end
            jsonschema.validate(json.loads(out.text), ENUM)


def test_stop_strings_search_the_answer_only(tiny_thinking_dir):
    tok, start, end = markers(tiny_thinking_dir)
    engine = engine_for(tiny_thinking_dir)
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, thinking=Thinking((start,), (end,), budget=6))
    out = run(engine, [GenerationRequest("free", prompt(tok, "Go"), free)])["free"].outputs[0]
    inside = tok.decode(out.token_ids[1:7])
    after = out.text
    stop = inside.strip()[:3]  # text the thinking holds
    assert stop
    stopped = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop],
                             thinking=Thinking((start,), (end,), budget=6))
    cut = run(engine, [GenerationRequest("cut", prompt(tok, "Go"), stopped)])["cut"].outputs[0]
    assert cut.thinking_tokens == 8 and cut.thinking_text == out.thinking_text  # not cut inside the block
    assert cut.text == (after[: after.index(stop)] if stop in after else after)


def test_a_prompt_that_opened_the_block_is_not_opened_again(tiny_thinking_dir):
    tok, start, end = markers(tiny_thinking_dir)
    engine = engine_for(tiny_thinking_dir)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                            thinking=Thinking((start,), (end,), budget=3, opened=True))
    out = run(engine, [GenerationRequest("r", prompt(tok, "Hi") + [start], params)])["r"].outputs[0]
    assert out.token_ids[3] == end and start != out.token_ids[0] and out.thinking_tokens == 4

"""An Anthropic prefill (a last assistant turn) through the codec and run-batch on a tiny model: the
prompt ends inside the assistant turn, left open, and the reply is only what the model wrote after it.
A chat body's last assistant turn stays a finished one, as OpenAI reads it."""

from __future__ import annotations

import json

import pytest

from batchapi.engine import EngineConfig, EngineFront
from batchapi.openai.body import CHAT, MESSAGES, parse_body
from batchapi.validation.token_counts import PromptCounter, exact_counts
from batchapi.workers.codec import prompt_token_ids
from batchapi.workers.run_batch import run_batch

PREFILL = "The answer is"
TURNS = [{"role": "user", "content": "What is 6 x 7?"}, {"role": "assistant", "content": PREFILL}]
USER_TURN = "<|im_start|>user\nWhat is 6 x 7?<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def front(tiny_llama_dir):
    front = EngineFront(EngineConfig(model_path=tiny_llama_dir, dtype="float32", kv_cache_bytes=4 << 20,
                                     max_num_seqs=2, max_model_len=200)).start()
    yield front
    front.shutdown()


def messages_body(**extra) -> dict:
    return {"model": "m", "max_tokens": 4, "temperature": 0, "messages": TURNS, **extra}


def test_a_prefill_is_rendered_open_for_the_model_to_continue(tokenizer):
    text = tokenizer.decode(prompt_token_ids(parse_body(MESSAGES, messages_body()), tokenizer))
    assert text.endswith(f"{USER_TURN}<|im_start|>assistant\n{PREFILL}")  # no <|im_end|>, no new turn


def test_a_prefill_with_tools_is_rendered_open_too(tokenizer):
    tool = {"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
    text = tokenizer.decode(prompt_token_ids(parse_body(MESSAGES, messages_body(tools=[tool])), tokenizer))
    assert "<tools>" in text and text.endswith(f"<|im_start|>assistant\n{PREFILL}")


def test_a_chat_bodys_last_assistant_turn_is_closed_and_answered(tokenizer):
    parsed = parse_body(CHAT, {"model": "m", "messages": TURNS})
    text = tokenizer.decode(prompt_token_ids(parsed, tokenizer))
    assert text.endswith(f"<|im_start|>assistant\n{PREFILL}<|im_end|>\n<|im_start|>assistant\n")


def test_a_prefill_runs_and_its_message_holds_only_the_continuation(tmp_path, front, tokenizer):
    line = {"custom_id": "p", "method": "POST", "url": MESSAGES, "body": messages_body()}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(line) + "\n")
    counts = run_batch(src, dst, front=front, progress=False)
    assert (counts.completed, counts.failed) == (1, 0)
    [record] = map(json.loads, dst.read_text().splitlines())
    message = record["response"]["body"]
    assert record["response"]["status_code"] == 200 and message["type"] == "message"
    open_prompt = tokenizer.apply_chat_template(TURNS[:1], add_generation_prompt=True, tokenize=False) + PREFILL
    usage = message["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(tokenizer.encode(open_prompt))
    [block] = message["content"]
    assert block["type"] == "text" and not block["text"].startswith(PREFILL)
    assert usage["output_tokens"] <= 4


def test_validation_counts_a_prefill_as_the_worker_renders_it(tiny_llama_dir, tokenizer):
    parsed = parse_body(MESSAGES, messages_body())
    assert exact_counts(PromptCounter(tiny_llama_dir), [parsed]) == [len(prompt_token_ids(parsed, tokenizer))]

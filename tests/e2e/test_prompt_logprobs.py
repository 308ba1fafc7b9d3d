"""Prompt logprobs through the unmodified openai SDK, against a live server on PostgreSQL and
SeaweedFS with the embedded worker, on the tiny random Llama in float32: `/v1/completions` lines
with `echo`, `logprobs` and `max_tokens: 0` return each prompt token's logprob (transformers'
`log_softmax` to 1e-4, `null` for the first), for prompts as strings, token ids and lists of
either (a choice per prompt), with generated tokens after the prompt when `max_tokens` > 0."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.utils.batch_service import embedded_stack, run_to_end

SETTINGS = dict(shard_size=8, max_num_seqs=16, auth_required=False, dtype="float32")
CONTEXT = "Question: what is the colour of the sky on a clear day? Answer:"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, s3):
    with embedded_stack(tmp_path_factory.mktemp("echo"), tiny_llama_dir, "prompt_logprobs", s3, **SETTINGS) as server:
        yield server


def completion(custom_id: str, model: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "temperature": 0, **body}}


def test_echo_returns_the_prompt_logprobs_of_transformers(openai_client, model, tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    context = tokenizer.encode(CONTEXT)
    choices = [context + tokenizer.encode(word, add_special_tokens=False) for word in (" blue", " green", " red")]
    lines = [completion("ids", model, choices[0], echo=True, logprobs=5, max_tokens=0),
             completion("many", model, choices, echo=True, logprobs=1, max_tokens=0),
             completion("text", model, CONTEXT, echo=True, logprobs=2, max_tokens=3),
             completion("plain", model, CONTEXT, max_tokens=3)]
    _, out, errors = run_to_end(openai_client, lines, "/v1/completions")
    assert not errors, errors

    def check(choice, ids):
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        for t in range(1, len(ids)):
            assert abs(logprobs["token_logprobs"][t] - expected[t - 1, ids[t]].item()) < 1e-4

    body = out["ids"]["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(choices[0]) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(choices[0]) and len(choice["logprobs"]["top_logprobs"][1]) == 5
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(choices[0])
    check(choice, choices[0])

    many = out["many"]["response"]["body"]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    for c, ids in zip(many["choices"], choices, strict=True):
        check(c, ids)
    assert many["usage"]["prompt_tokens"] == sum(len(ids) for ids in choices)
    # the choices share their context: the same logprobs there, each its own after it
    first = many["choices"][0]["logprobs"]["token_logprobs"][: len(context)]
    assert all(c["logprobs"]["token_logprobs"][: len(context)] == first for c in many["choices"])

    text = out["text"]["response"]["body"]["choices"][0]
    plain = out["plain"]["response"]["body"]["choices"][0]
    assert text["text"] == CONTEXT + plain["text"]  # the prompt, then what it generates without echo
    assert len(text["logprobs"]["tokens"]) == len(context) + 3
    check(text, context)
    assert all(lp is not None for lp in text["logprobs"]["token_logprobs"][1:])


def test_max_tokens_zero_needs_echo_and_one_choice(openai_client, model):
    _, out, errors = run_to_end(openai_client, [completion("zero", model, "Hi", max_tokens=0),
                                                completion("many", model, [[1, 2], "text"]),
                                                completion("twice", model, "Hi", echo=True, max_tokens=0, n=2),
                                                completion("bare", model, CONTEXT, echo=True, max_tokens=0)],
                                "/v1/completions")
    assert set(out) == {"bare"} and set(errors) == {"zero", "many", "twice"}
    assert errors["zero"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert errors["many"]["response"]["body"]["error"]["param"] == "prompt"
    assert errors["twice"]["response"]["body"]["error"]["param"] == "n"
    bare = out["bare"]["response"]["body"]  # the prompt echoed, nothing generated, no logprobs asked for
    assert [(c["text"], c["logprobs"], c["finish_reason"]) for c in bare["choices"]] == [(CONTEXT, None, "length")]
    assert bare["usage"]["completion_tokens"] == 0

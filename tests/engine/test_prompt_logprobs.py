"""Prompt logprobs (``engine.prompt_scores``): in float32 every prompt token's logprob equals
transformers' ``log_softmax`` of the same model to 1e-4 on the tiny model of every family, with
chunked prefills; ``max_tokens`` 0 scores the prompt and generates nothing; prompts that share a
context share its KV (prefix-cache hits) and get the very same scores as alone; and in bfloat16 a
prompt's scores do not depend on what else is in the batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchapi.engine import GenerationRequest, SamplingParams
from tests.engine.test_engine import PROMPTS, engine_for, tokenize
from tests.engine.test_structured import run

FAMILIES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_mixtral_dir",
            "tiny_gemma2_dir", "tiny_gemma3_dir"]


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: the log_softmax at each position, for the token after it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def scored(max_tokens=0, k=3, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=k, **kw)


@pytest.mark.parametrize("fixture", FAMILIES)
def test_prompt_logprobs_equal_transformers_in_float32(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = tokenize(model_dir, PROMPTS[1:4])
    # a small token budget: the prompts are prefilled in chunks, scored across chunk boundaries
    engine = engine_for(model_dir, max_num_batched_tokens=16, max_num_seqs=4)
    results = run(engine, [GenerationRequest(f"p{i}", ids, scored()) for i, ids in enumerate(prompts)])
    for i, ids in enumerate(prompts):
        result = results[f"p{i}"]
        assert result.outputs[0].token_ids == [] and result.outputs[0].finish_reason == "length"
        entries = result.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        expected = hf_logprobs(model_dir, ids)
        for t in range(1, len(ids)):
            assert entries[t].token_id == ids[t]
            assert abs(entries[t].logprob - expected[t - 1, ids[t]].item()) < 1e-4, (fixture, t)
            top = torch.topk(expected[t - 1], 3)
            assert [a for a, _ in entries[t].top_logprobs] == top.indices.tolist()
            assert all(abs(lp - e) < 1e-4 for (_, lp), e in zip(entries[t].top_logprobs, top.values.tolist(),
                                                                 strict=True))


def test_choices_of_one_context_share_its_kv_and_get_the_same_scores(tiny_llama_dir):
    [context] = tokenize(tiny_llama_dir, ["Question: which of these numbers is the largest one of all? " * 3])
    choices = [context + [100 + i, 200 + i, 300 + i] for i in range(4)]
    alone = [run(engine_for(tiny_llama_dir), [GenerationRequest("a", ids, scored(k=5))])["a"] for ids in choices]
    engine = engine_for(tiny_llama_dir)
    first = run(engine, [GenerationRequest("c0", choices[0], scored(k=5))])["c0"]
    rest = run(engine, [GenerationRequest(f"c{i}", ids, scored(k=5)) for i, ids in enumerate(choices[1:], 1)])
    assert first.cached_tokens == 0 and len(engine.runner.scores) >= len(context) // 16
    for i in range(1, 4):
        assert rest[f"c{i}"].cached_tokens == len(context) // 16 * 16  # the context's full blocks: hits
    for i, result in enumerate([first, *(rest[f"c{i}"] for i in range(1, 4))]):
        assert result.prompt_logprobs == alone[i].prompt_logprobs  # to the bit, hits or not


def test_generation_after_the_prompt_and_plain_requests_beside(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, PROMPTS)
    engine = engine_for(tiny_llama_dir)
    results = run(engine, [GenerationRequest("scored", prompts[1], scored(max_tokens=5, k=0, logprobs=True)),
                           GenerationRequest("plain", prompts[1], SamplingParams(max_tokens=5, temperature=0))])
    assert results["scored"].outputs[0].token_ids == results["plain"].outputs[0].token_ids
    assert results["plain"].prompt_logprobs is None
    entries = results["scored"].prompt_logprobs
    assert all(e.top_logprobs == [] for e in entries[1:])  # k 0: the token's own logprob only
    with pytest.raises(ValueError, match="max_tokens 0"):
        SamplingParams(max_tokens=0)


def test_scores_do_not_depend_on_the_batch_in_bfloat16(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, PROMPTS)

    def engine():  # a small token budget: beside others, the prompt is cut into other chunks
        return engine_for(tiny_llama_dir, dtype="bfloat16", max_num_batched_tokens=32, max_num_seqs=8)

    alone = run(engine(), [GenerationRequest("x", prompts[3], scored(k=4))])["x"]
    crowd = [GenerationRequest(f"o{i}", ids, SamplingParams(max_tokens=6, temperature=0))
             for i, ids in enumerate(prompts)]
    mixed = run(engine(), [*crowd[:2], GenerationRequest("x", prompts[3], scored(k=4)), *crowd[2:]])["x"]
    assert mixed.prompt_logprobs == alone.prompt_logprobs


def test_a_prompt_of_the_whole_context_is_scored(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, max_model_len=64)
    ids = (tokenize(tiny_llama_dir, [PROMPTS[3]])[0] * 8)[:64]
    results = run(engine, [GenerationRequest("full", ids, scored()),
                           GenerationRequest("more", ids, scored(max_tokens=1))])
    assert results["full"].error is None and len(results["full"].prompt_logprobs) == 64
    assert results["more"].error is not None  # a token more would not fit

"""overlap_text: a step's text work (detokenizing, stop strings) done while the next step runs gives
the same results as doing it at once: tokens, text, finish reasons and logprobs, on CPU, where the
engine runs it only when asked (it is the default on CUDA)."""

from __future__ import annotations

from batchapi.engine import SamplingParams
from tests.engine.test_engine import PROMPTS, SHARED, engine_for, run, tokenize


def outputs(results):
    return [[(o.index, o.token_ids, o.text, o.finish_reason, o.logprobs) for o in r.outputs] + [r.error]
            for r in results]


def workload(model_dir, texts=(*PROMPTS, SHARED + PROMPTS[1], SHARED + PROMPTS[2]), max_tokens=24):
    prompts = tokenize(model_dir, list(texts))
    plain = run(engine_for(model_dir), prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    params = []
    for i, result in enumerate(plain):
        text, ids = result.outputs[0].text, result.outputs[0].token_ids
        kind = i % 4
        if kind == 0:  # a stop string in the middle
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                         stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
        elif kind == 1:  # a stop string completed by the last token max_tokens allows: "stop" beats "length"
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=[text[-2:]],
                                         logprobs=True, top_logprobs=2))
        elif kind == 2:  # a stop token, and n > 1
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[ids[5]], n=2))
        else:  # seeded sampling with a stop string that may or may not come
            params.append(SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7 + i, stop=[" the", "e"]))
    return prompts, params


def test_overlapped_text_gives_the_same_results(tiny_llama_dir):
    prompts, params = workload(tiny_llama_dir)
    at_once = run(engine_for(tiny_llama_dir, overlap_text=False), prompts, params)
    overlapped = engine_for(tiny_llama_dir, overlap_text=True)
    assert overlapped.overlap_text
    assert outputs(run(overlapped, prompts, params)) == outputs(at_once)
    assert {o.finish_reason for r in at_once for o in r.outputs} >= {"stop"}
    assert not overlapped.has_unfinished() and overlapped.block_manager.num_free_blocks == overlapped.runner.num_blocks


def test_overlapped_text_under_preemption_gives_the_same_results(tiny_llama_dir):
    prompts, params = workload(tiny_llama_dir, PROMPTS, max_tokens=40)
    prompts, params = prompts * 2, params + [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 5
    at_once = run(engine_for(tiny_llama_dir, overlap_text=False), prompts, params)
    # 512 bytes a token of KV (see test_engine's preemption test): 8 blocks, 128 tokens
    small = engine_for(tiny_llama_dir, overlap_text=True, kv_cache_bytes=8 * 16 * 512, max_num_seqs=5)
    assert outputs(run(small, prompts, params)) == outputs(at_once)
    assert small.scheduler.num_preemptions > 0


def test_the_default_overlaps_on_cuda_only(tiny_llama_dir):
    assert not engine_for(tiny_llama_dir).overlap_text  # CPU: the forward holds the cores, nothing to overlap

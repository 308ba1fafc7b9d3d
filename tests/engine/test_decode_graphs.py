"""Decode graphs (CUDA graphs of decode steps at bucketed batch sizes): the buckets, and the padded
step they run, checked on CPU with capture off: the same tokens and logprobs as unpadded steps."""

from __future__ import annotations

from batchapi.engine import SamplingParams
from batchapi.engine.model_runner import DecodeGraphs, graph_buckets
from tests.engine.test_engine import PROMPTS, SHARED, engine_for, run, tokenize


def test_buckets_cover_every_batch_size_with_little_padding():
    buckets = graph_buckets(256)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 256
    for size in range(1, 257):
        bucket = next(b for b in buckets if b >= size)
        assert bucket - size < (8 if size <= 256 else 16)
    assert graph_buckets(5) == [1, 2, 4, 5] and graph_buckets(1000)[-1] == 1000
    assert max(b - a for a, b in zip(graph_buckets(1000), graph_buckets(1000)[1:], strict=False)) == 16


def padded(model_dir, **kw):
    engine = engine_for(model_dir, **kw)
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.model, engine.config.max_num_seqs, runner.max_context_len,
                                 runner.block_size, runner.device, capture=False)
    return engine


def test_padded_decode_steps_give_the_tokens_of_unpadded_ones(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, [*PROMPTS, SHARED + PROMPTS[1], SHARED + PROMPTS[3], "A"])
    params = [SamplingParams(max_tokens=12 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
              for i in range(len(prompts))]
    params[2] = SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    expected = run(engine_for(tiny_llama_dir), prompts, params)
    engine = padded(tiny_llama_dir)
    got = run(engine, prompts, params)
    assert engine.runner.graphs.replays > 10  # batches of 8 down to 1 running sequence, padded to buckets
    for a, b in zip(got, expected, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_padded_steps_with_preemption_and_forks(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, PROMPTS)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, n=2)
    expected = run(engine_for(tiny_llama_dir), prompts, params)
    engine = padded(tiny_llama_dir, kv_cache_bytes=8 * 16 * 512, max_num_seqs=6)
    got = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0 and engine.runner.graphs.replays > 0
    assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in expected]

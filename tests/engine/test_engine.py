"""LLMEngine end to end on CPU: parity with Hugging Face generate and the cache/scheduling paths."""

from __future__ import annotations

import ctypes
import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchapi.engine import (
    DuplicateRequestId,
    EngineConfig,
    ErrorCode,
    GenerationRequest,
    LLMEngine,
    SamplingParams,
    UnsupportedModelError,
)

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a king who had three daughters and",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,",
    "Hi",
]
SHARED = "You are a careful assistant. Answer in one short sentence, without any preamble. " * 2


def greedy(max_tokens=16, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(engine: LLMEngine, prompts: list[list[int]], params) -> list:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerationRequest(f"r{i}", ids, p))
    results = {}
    while engine.has_unfinished():
        for result in engine.step():
            results[result.request_id] = result
    return [results[f"r{i}"] for i in range(len(prompts))]


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # eager attention: transformers' SDPA path has no logit soft-cap (Gemma 2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    for ids in prompts:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def engine_for(model_dir, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_bytes", 4 << 20)
    return LLMEngine(EngineConfig(model_path=model_dir, **kw))


def tokenize(model_dir, texts):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"] for t in texts]


def test_greedy_tokens_from_the_lm_head_are_those_of_the_logits(smollm2_dir, monkeypatch):
    """SmolLM2 in the engine's dtype here: where the lm_head runs in a C kernel (bf16-stored in
    float32; bf16 on AVX512-BF16 or AMX tiles), greedy steps take their tokens from it without writing
    logits (CausalLM.greedy); the tokens are those of the logits' argmax, and a row that asks for
    logprobs still gets them (that step writes logits). On AVX512-BF16 with VNNI the lm_head screens
    its outputs in int8 and computes few exactly."""
    from batchapi.engine.model.linears import Avx512Bf16Linear
    from batchapi.engine.model.llama import CausalLM
    from batchapi.engine.platform import fastest_cpu_dtype
    from batchapi.kernels.cpu import matmul

    prompts = tokenize(smollm2_dir, PROMPTS[:3])
    engine = engine_for(smollm2_dir, dtype="auto", kv_cache_bytes=64 << 20)
    if fastest_cpu_dtype() is torch.bfloat16:
        in_kernel = matmul.native_amx() or matmul.native_bf16()
    else:  # float32, the bf16 checkpoint's weights stored in bf16
        in_kernel = matmul.available()
    assert engine.runner.model.greedy_in_lm_head == in_kernel
    head = engine.runner.model.lm_head
    screened = type(head) is Avx512Bf16Linear and matmul.screen_native()
    assert (getattr(head, "screen", None) is not None) == screened
    calls = []
    greedy_steps = CausalLM.greedy
    monkeypatch.setattr(CausalLM, "greedy", lambda self, *a: calls.append(1) or greedy_steps(self, *a))
    fused = [r.outputs[0].token_ids for r in run(engine, prompts, greedy(12))]
    with_logprobs = run(engine, prompts, greedy(12, logprobs=True))
    assert bool(calls) == in_kernel
    if screened:  # every row's groups of 48 columns: about 1,000
        assert 0 < head.exact_groups < head.screened_rows * -(-head.out_features // 48) / 20
    monkeypatch.setattr(CausalLM, "greedy_in_lm_head", property(lambda self: False))
    assert [r.outputs[0].token_ids for r in run(engine, prompts, greedy(12))] == fused
    assert [r.outputs[0].token_ids for r in with_logprobs] == fused
    assert all(r.outputs[0].logprobs for r in with_logprobs)


def test_both_bf16_instructions_give_the_same_tokens_and_logprobs(smollm2_dir):
    """SmolLM2 in bf16 through the whole engine (prefill, decode, logprobs, greedy in the lm_head):
    the C kernel's VDPBF16PS and its FMAs in that instruction's order give the same tokens and the
    same logprob bits (where the kernel runs in plain C or AMX tiles, the same path twice)."""
    from batchapi.kernels.cpu import matmul

    prompts = tokenize(smollm2_dir, PROMPTS[:4])
    before = matmul.bf16_instructions() if matmul.available() else None
    outputs = []
    try:
        for name in matmul.INSTRUCTIONS:
            if before is not None:
                matmul.bf16_instructions(name)
            engine = engine_for(smollm2_dir, dtype="bfloat16", kv_cache_bytes=64 << 20, enable_prefix_caching=False)
            runs = run(engine, prompts, greedy(10, logprobs=True)) + run(engine, prompts, greedy(10))
            outputs.append([(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in runs])
    finally:
        if before is not None:
            matmul.bf16_instructions(before)
    assert outputs[0] == outputs[1]
    assert all(r[1] for r in outputs[0][:len(prompts)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch, fields", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 16})],
                         ids=["llama", "qwen2-qkv-bias", "mistral-window"])
def test_a_steps_layers_in_one_c_call_give_the_python_loops_bits(tmp_path, smollm2_dir, monkeypatch, arch, fields,
                                                                 dtype):
    """Models whose projections all run a C kernel (bf16 ones on AVX512-BF16 or AMX; in float32 the bf16
    checkpoint's weights stored in bf16) run a step's layers in one C call (kernels/cpu/decoder.py):
    prompts chunked and mixed with decodes, a qkv bias, a window narrower than the prompts; the same
    tokens and logprob bits as the Python loop over the layers, and every step in C (in bf16 with
    SiLU-and-mul in the gate_up kernel's epilogue). Where the projections run oneDNN (bf16 without
    AVX512-BF16) no step can, and both runs are the loop."""
    from batchapi.kernels.cpu import matmul
    from batchapi.kernels.cpu.decoder import DecoderLayers
    from tests.utils.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / arch, smollm2_dir, arch, save_dtype="bfloat16", **fields)
    prompts = tokenize(model_dir, PROMPTS)
    ran, outputs = [], []
    real = DecoderLayers.run

    def counted(self, *args):
        out = real(self, *args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(DecoderLayers, "run", counted)
    for in_c in (True, False):
        engine = engine_for(model_dir, dtype=dtype, max_num_seqs=3, max_num_batched_tokens=16,
                            enable_prefix_caching=False)
        engine.runner.model.layers_in_c = in_c
        results = run(engine, prompts, greedy(24, logprobs=True))
        outputs.append([(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results])
    assert outputs[0] == outputs[1]
    assert all(r[1] for r in outputs[0])
    kinds = engine.runner.linear_kinds
    in_c = kinds["avx512-bf16"] + kinds["amx-bf16"] if dtype == "bfloat16" else kinds["bf16-stored"]
    in_c_kernels = in_c == 4 * engine.runner.model_config.num_layers + 1
    assert in_c_kernels or (dtype == "bfloat16" and not matmul.native_bf16())
    assert (len(ran) > 20 and all(ran)) if in_c_kernels else not any(ran)
    model = engine.runner.model
    assert (model._decoder_layers() is not None) == in_c_kernels
    if in_c_kernels:  # in bf16 each gate_up ran SiLU-and-mul in its epilogue (linear_bf16_silu, linear_amx_silu)
        assert model._decoder_layers().act_in_gate_up == (dtype == "bfloat16")
    down = model.layers[-1].mlp.down_proj
    down.forward = down.forward  # as a profiler wraps it: the step must call it, so the loop runs
    assert model._decoder_layers() is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_steps_that_copy_a_shared_prefix_inside_a_block_run_in_one_c_call(tmp_path, smollm2_dir, monkeypatch, dtype):
    """Prompts whose shared prefix ends inside a block, admitted while others run: a later prompt takes
    that block's shared tokens from a running sequence's block (the scheduler's KVCopy, in waves),
    copied after each layer's KV store. Those steps run in one C call as well, with the Python loop's
    bits (the same tokens and logprob bits); a copy whose slot lies outside the pool sends the step
    back to the loop, which raises."""
    from batchapi.engine.model.layers import AttentionMetadata
    from batchapi.kernels.cpu.decoder import DecoderLayers
    from tests.utils.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "llama", smollm2_dir, "llama", save_dtype="bfloat16")
    prompts = tokenize(model_dir, [SHARED + p for p in PROMPTS])
    real = DecoderLayers.run
    ran, outputs = [], []

    def counted(self, *args):
        out = real(self, *args)
        ran.append((out is not None, len(args[-1])))
        return out

    monkeypatch.setattr(DecoderLayers, "run", counted)
    for in_c in (True, False):
        engine = engine_for(model_dir, dtype=dtype, max_num_seqs=2, max_num_batched_tokens=24)
        engine.runner.model.layers_in_c = in_c
        results = run(engine, prompts, greedy(12, logprobs=True))
        outputs.append([(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results])
    assert outputs[0] == outputs[1]
    model = engine.runner.model
    if model._decoder_layers() is None:  # bf16 projections in oneDNN here: no step runs in C
        assert not ran
        return
    copied = [waves for done, waves in ran if waves]
    assert copied and all(done for done, _ in ran), ran
    x = torch.zeros(1, engine.runner.model_config.hidden_size, dtype=engine.runner.dtype)
    pool = model.layers[0].self_attn.k_cache
    slots = pool.shape[0] * pool.shape[1]
    one = torch.zeros(1, dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=one, block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                             context_lens=torch.ones(1, dtype=torch.int32), max_seqlen_q=1, max_context_len=1,
                             kv_copies=[(one, torch.tensor([slots]))])
    assert model._run_layers_in_c(x, one, meta) is None
    model.layers_in_c = True  # the C call refuses, and the loop raises
    with pytest.raises(IndexError):
        model.final_hidden(torch.zeros(1, dtype=torch.int64), one, meta, one)


def test_the_one_c_call_copies_wave_by_wave_as_the_loop(tmp_path, smollm2_dir, monkeypatch):
    """A decode step with two waves of in-block copies, the first copying a row the step's own KV
    store wrote, the second the row the first copied there: the one C call leaves the caches and the
    hidden state the layers' Python loop leaves (float32: the bf16-stored kernel, in C on every CPU)."""
    from batchapi.engine.model.layers import AttentionMetadata
    from batchapi.kernels.cpu.decoder import DecoderLayers
    from tests.utils.tiny_models import build_tiny_model

    real, ran = DecoderLayers.run, []
    monkeypatch.setattr(DecoderLayers, "run", lambda self, *args: ran.append(real(self, *args)) or ran[-1])

    model_dir = build_tiny_model(tmp_path / "llama", smollm2_dir, "llama", save_dtype="bfloat16")
    engine = engine_for(model_dir, dtype="float32")
    model = engine.runner.model
    assert model._decoder_layers() is not None
    caches = [c for layer in model.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(c.shape, generator=generator, dtype=c.dtype) for c in caches]
    meta = AttentionMetadata(slot_mapping=torch.tensor([20]), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                             context_lens=torch.tensor([21], dtype=torch.int32), max_seqlen_q=1, max_context_len=21,
                             kv_copies=[(torch.tensor([20, 3]), torch.tensor([40, 41])),
                                        (torch.tensor([40]), torch.tensor([50]))])
    outputs = []
    for in_c in (True, False):
        for cache, values in zip(caches, start, strict=True):
            cache.copy_(values)
        model.layers_in_c = in_c
        hidden = model.final_hidden(torch.tensor([7]), torch.tensor([20]), meta, torch.tensor([0]))
        outputs.append((hidden, [c.clone() for c in caches]))
    (c_hidden, c_caches), (loop_hidden, loop_caches) = outputs
    assert torch.equal(c_hidden, loop_hidden)
    assert all(torch.equal(a, b) for a, b in zip(c_caches, loop_caches, strict=True))
    assert len(ran) == 1 and ran[0] is not None  # the C call ran the step (the loop's run does not call it)
    rows, before = (c.view(-1, *c.shape[2:]) for c in (loop_caches[0], start[0]))  # layer 0's keys by slot
    assert torch.equal(rows[50], rows[20]) and not torch.equal(rows[20], before[20])  # the stored row, twice copied
    assert torch.equal(rows[41], before[3])


def test_the_kv_pool_starts_on_a_page_and_zero(tiny_llama_dir):
    """Each layer's KV cache is zero and starts on a page boundary (calloc's own pointer lies 16 bytes
    past one: every row across one more cache line than it fills)."""
    engine = engine_for(tiny_llama_dir)
    for layer in engine.runner.model.layers:
        for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
            assert cache.data_ptr() % 4096 == 0
            assert not cache.any()


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(pages of t's memory faulted in, pages in all), by mincore(2); t starts on a page."""
    pages = -(-t.nbytes // 4096)
    vec = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL("libc.so.6").mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.nbytes), vec) == 0
    return sum(v & 1 for v in vec), pages


def test_the_kv_pool_is_faulted_in_at_start_or_when_idle_and_keeps_every_byte(tiny_llama_dir):
    """kv_pool_prefault: "off" leaves the pool's pages to the steps that first write them (whether
    calloc's are fresh depends on what this process freed before); "start" faults every page in
    before the engine is built; "idle" (the default) on a thread that
    runs while the CPUs idle, which a run beside it does not disturb: the same tokens, the pool zero
    where no step wrote. Closing the engine stops the thread."""
    prompts = tokenize(tiny_llama_dir, PROMPTS)

    def caches(engine):
        return [c for layer in engine.runner.model.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]

    def faulted(engine) -> float:
        counts = [resident_pages(c) for c in caches(engine)]
        return sum(r for r, _ in counts) / sum(n for _, n in counts)

    off = engine_for(tiny_llama_dir, kv_pool_prefault="off", kv_cache_bytes=256 << 20)
    assert off.runner.pool_warmer is None
    expected = [r.outputs[0].token_ids for r in run(off, prompts, greedy(24))]
    off.close()
    start = engine_for(tiny_llama_dir, kv_pool_prefault="start", kv_cache_bytes=64 << 20)
    assert faulted(start) == 1.0 and not any(c.any() for c in caches(start))
    idle = engine_for(tiny_llama_dir, kv_cache_bytes=256 << 20)
    warmer = idle.runner.pool_warmer
    assert [r.outputs[0].token_ids for r in run(idle, prompts, greedy(24))] == expected  # while it warms
    deadline = time.monotonic() + 60
    while warmer.warmed < warmer.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warmer.warmed == warmer.num_blocks and faulted(idle) == 1.0
    used = sum(-(-(len(p) + 24) // 16) for p in prompts)  # the run's blocks are some of 0, 1, ..., used - 1
    assert not any(c[used:].any() for c in caches(idle))
    idle.close()
    assert not warmer._thread.is_alive()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir",
                                     "tiny_mixtral_dir", "tiny_gemma2_dir", "tiny_gemma3_dir"])
def test_greedy_parity_with_hf_on_tiny_models(fixture, request):
    """Gemma's windows (12 tokens) are narrower than the longer prompts: its local layers attend to less."""
    model_dir = request.getfixturevalue(fixture)
    prompts = tokenize(model_dir, PROMPTS)
    expected = hf_greedy(model_dir, prompts, 24)
    # a small budget and seq cap: prompts are chunked and decodes mix with prefills
    engine = engine_for(model_dir, max_num_seqs=3, max_num_batched_tokens=16)
    results = run(engine, prompts, greedy(24))
    assert [r.outputs[0].token_ids for r in results] == expected
    assert all(r.outputs[0].finish_reason == "length" and r.completion_tokens == 24 for r in results)
    assert [r.prompt_tokens for r in results] == [len(p) for p in prompts]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma3"])
def test_greedy_parity_with_hf_on_bf16_checkpoints_kept_in_bf16(tmp_path, smollm2_dir, arch):
    """A bf16 checkpoint in float32 (the dtype without native bf16 matmuls): the engine keeps its
    linear weights in bf16 and widens them as it multiplies; transformers widens them at load."""
    from tests.utils.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / arch, smollm2_dir, arch, save_dtype="bfloat16")
    prompts = tokenize(model_dir, PROMPTS)
    expected = hf_greedy(model_dir, prompts, 16)
    engine = engine_for(model_dir, max_num_seqs=3, max_num_batched_tokens=16)
    assert engine.runner.linear_kinds["bf16-stored"] > 0 and engine.runner.linear_kinds["onednn"] == 0
    results = run(engine, prompts, greedy(16))
    assert [r.outputs[0].token_ids for r in results] == expected
    widened = engine_for(model_dir, bf16_weights=False)  # another order of the sums: another fingerprint
    assert widened.runner.linear_kinds["bf16-stored"] == 0
    assert widened.system_fingerprint != engine.system_fingerprint


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
], ids=["yarn", "linear"])
def test_greedy_parity_with_hf_under_scaled_rope(tmp_path, smollm2_dir, rope):
    """Prompts past the original context, so the scaled frequencies (and YaRN's attention factor) count."""
    from tests.utils.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "scaled", smollm2_dir, "llama", rope_parameters=rope)
    prompts = tokenize(model_dir, [PROMPTS[1] + " " + PROMPTS[3], PROMPTS[0]])
    assert len(prompts[0]) > 32
    expected = hf_greedy(model_dir, prompts, 16)
    results = run(engine_for(model_dir, max_num_seqs=2, max_num_batched_tokens=32), prompts, greedy(16))
    assert [r.outputs[0].token_ids for r in results] == expected


def test_a_window_on_every_layer_releases_blocks_and_still_matches(tmp_path, smollm2_dir):
    """Mistral's 16-token window on every layer: a sequence holds the blocks of its window only, so
    generations far past the window run in a pool that could not hold them whole, as transformers
    generates them."""
    from tests.utils.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "mistral", smollm2_dir, "mistral", sliding_window=16)
    prompts = tokenize(model_dir, PROMPTS[1:4])
    expected = hf_greedy(model_dir, prompts, 80)
    # 12 blocks of 16 tokens: three sequences of ~130 tokens would need 27 without releasing
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads of 16, fp32, 16 tokens
    engine = engine_for(model_dir, max_num_seqs=3, max_num_batched_tokens=16, kv_cache_bytes=12 * block_bytes)
    assert engine.runner.num_blocks == 12
    results = run(engine, prompts, greedy(80))
    assert [r.outputs[0].token_ids for r in results] == expected
    assert engine.scheduler.num_preemptions == 0


def test_greedy_parity_with_hf_on_smollm2(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=False) for c in chats]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    expected = hf_greedy(smollm2_dir, prompts, 20)
    engine = engine_for(smollm2_dir, kv_cache_bytes=64 << 20)
    results = run(engine, prompts, greedy(20))
    assert [r.outputs[0].token_ids for r in results] == expected
    assert "Paris" in results[0].outputs[0].text


def test_prefix_caching_on_and_off_give_the_same_tokens(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, [SHARED + p for p in PROMPTS] + [SHARED + PROMPTS[0]])
    off = run(engine_for(tiny_llama_dir, enable_prefix_caching=False), prompts, greedy())
    on = run(engine_for(tiny_llama_dir, enable_prefix_caching=True), prompts, greedy())
    assert [r.outputs[0].token_ids for r in on] == [r.outputs[0].token_ids for r in off]
    assert all(r.cached_tokens == 0 for r in off)
    shared_blocks = len(tokenize(tiny_llama_dir, [SHARED])[0]) // 16 * 16
    assert on[0].cached_tokens == 0
    assert all(r.cached_tokens >= shared_blocks for r in on[1:])


def test_prefix_reuse_inside_a_block_gives_the_same_tokens(tiny_llama_dir):
    # b reuses 3 of a's tokens, c 5 of b's (3 of which b receives by a copy in the same step);
    # d, added a step later, hits a's first block and copies 4 more tokens from it
    long = list(range(100, 120))
    prompts = [[5, 6, 7, 50, 51], [5, 6, 7, 8, 9, 60], [5, 6, 7, 8, 9, 61, 62], long + [70, 71],
               long[:16] + [long[16], long[17], long[18], long[19], 80]]

    def staged(engine):
        for i in range(4):
            engine.add_request(GenerationRequest(f"r{i}", prompts[i], greedy(8)))
        results = {r.request_id: r for r in engine.step()}
        engine.add_request(GenerationRequest("r4", prompts[4], greedy(8)))
        while engine.has_unfinished():
            results.update((r.request_id, r) for r in engine.step())
        return [results[f"r{i}"] for i in range(len(prompts))]

    off = staged(engine_for(tiny_llama_dir, enable_prefix_caching=False))
    engine = engine_for(tiny_llama_dir, enable_prefix_caching=True)
    on = staged(engine)
    assert [r.outputs[0].token_ids for r in on] == [r.outputs[0].token_ids for r in off]
    assert [r.cached_tokens for r in on] == [0, 3, 5, 0, 20]


def test_small_kv_pool_preempts_and_still_matches(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, PROMPTS)
    expected = run(engine_for(tiny_llama_dir), prompts, greedy(40))
    # 2 layers x 2 KV heads x 16 dims x (K and V) x 4 bytes = 512 bytes a token: 8 blocks, 128 tokens
    engine = engine_for(tiny_llama_dir, kv_cache_bytes=8 * 16 * 512, max_num_seqs=5)
    results = run(engine, prompts, greedy(40))
    assert engine.scheduler.num_preemptions > 0
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in expected]
    assert engine.kv_usage() == 0.0 or engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_seeded_sampling_is_the_same_whatever_the_batch(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, PROMPTS)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run(engine_for(tiny_llama_dir), [prompts[1]], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    mixed = run(engine_for(tiny_llama_dir), prompts, [noise, seeded, noise, noise, noise])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = run(engine_for(tiny_llama_dir), [prompts[1]],
                     SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_samples_fork_from_one_prompt(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, [SHARED + PROMPTS[1]])
    single = run(engine_for(tiny_llama_dir), prompts, greedy(10))[0]
    engine = engine_for(tiny_llama_dir)
    result = run(engine, prompts, greedy(10, n=3))[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(o.token_ids == single.outputs[0].token_ids for o in result.outputs)
    assert result.completion_tokens == 30 and result.prompt_tokens == len(prompts[0])
    sampled = run(engine_for(tiny_llama_dir), prompts,
                  SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3, ignore_eos=True))[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1


def test_stop_string_is_excluded_and_stops(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, [PROMPTS[0]])
    full = run(engine_for(tiny_llama_dir), prompts, greedy(24))[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full.text!r}"
    cut = run(engine_for(tiny_llama_dir), prompts, greedy(24, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    eos = run(engine_for(tiny_llama_dir), prompts, greedy(24, stop_token_ids=[full.token_ids[3]]))[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]


def test_unfittable_request_finishes_with_an_error(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, max_model_len=32)
    long, short = tokenize(tiny_llama_dir, [" ".join(["word"] * 40), "Hi"])
    results = run(engine, [long, short, [10**9], []], greedy(4))
    assert results[0].outputs[0].finish_reason == "error" and "at most 32 tokens" in results[0].error
    assert results[0].error_code is ErrorCode.PROMPT_TOO_LONG
    assert results[1].error is None and results[1].error_code is None and results[1].completion_tokens == 4
    assert "outside the vocabulary" in results[2].error and results[2].error_code is ErrorCode.INVALID_REQUEST
    assert results[3].error == "the prompt is empty" and results[3].error_code is ErrorCode.PROMPT_EMPTY
    # max_tokens past the context: the sequence stops at the context length
    capped = run(engine, [short], [greedy(100)])[0]
    assert capped.outputs[0].finish_reason == "length" and capped.prompt_tokens + capped.completion_tokens == 32


def test_logprobs_match_a_log_softmax(tiny_llama_dir):
    prompts = tokenize(tiny_llama_dir, [PROMPTS[2]])
    out = run(engine_for(tiny_llama_dir), prompts, greedy(4, logprobs=True, top_logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for step in out.logprobs:
        assert step.top_logprobs[0][0] == step.token_id  # greedy picks the most likely
        assert step.logprob == pytest.approx(step.top_logprobs[0][1]) and step.logprob <= 0


def test_abort_drops_a_request(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    prompts = tokenize(tiny_llama_dir, PROMPTS[:2])
    engine.add_request(GenerationRequest("a", prompts[0], greedy(50)))
    engine.add_request(GenerationRequest("b", prompts[1], greedy(5)))
    engine.step()
    aborted = engine.abort("a")
    assert aborted.error == "aborted" and aborted.outputs[0].finish_reason == "error"
    assert aborted.error_code is ErrorCode.ABORTED
    assert engine.abort("a") is None
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [r.request_id for r in done] == ["b"] and engine.num_running() == 0


def test_a_duplicate_request_id_is_refused_while_the_first_runs(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    engine.add_request(GenerationRequest("a", [1, 2, 3], greedy(3)))
    with pytest.raises(DuplicateRequestId, match="'a' is already in the engine"):
        engine.add_request(GenerationRequest("a", [4, 5], greedy(3)))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [(r.request_id, r.completion_tokens) for r in done] == [("a", 3)]
    engine.add_request(GenerationRequest("a", [4, 5], greedy(2)))  # finished: the id is free again


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        LLMEngine(EngineConfig(model_path=tmp_path))


def test_what_the_engine_cannot_run_yet_is_refused_by_name(tmp_path, tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    cases = {
        "rope scaling 'longrope'": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                        "short_factor": [1.0], "long_factor": [1.0]}},
        "bidirectional attention": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                    "use_bidirectional_attention": True},
        "Gemma's MLP activation 'gelu'": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                                          "hidden_activation": "gelu"},
    }
    for message, change in cases.items():
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UnsupportedModelError, match=message):
            LLMEngine(EngineConfig(model_path=tmp_path, max_model_len=config["max_position_embeddings"]))


def test_each_layer_gets_the_window_transformers_applies(tmp_path, tiny_llama_dir):
    """Mistral's and Mixtral's window on every layer whenever set; Qwen2's and Qwen3's only with
    use_sliding_window, from max_window_layers on; Gemma's on its sliding layers (every other one for
    Gemma 2, five of six for Gemma 3 unless layer_types says); a window as wide as the context is none.
    The context is never bounded by a window."""
    from batchapi.engine.model.loader import load_config

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.pop("layer_types", None)
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 7}
    cases = [
        ({"use_sliding_window": True, "sliding_window": 64, "architectures": ["Qwen2ForCausalLM"],
          "model_type": "qwen2", "max_window_layers": 1}, (0, 64), None),
        ({"use_sliding_window": False, "sliding_window": 64, "architectures": ["Qwen2ForCausalLM"],
          "model_type": "qwen2"}, (), None),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}, (64, 64), 64),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 1024}, (), None),
        ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 64}, (64, 0), None),
        ({**gemma3, "sliding_window": 64}, (64, 64, 64, 64, 64, 0, 64), None),
        ({**gemma3, "sliding_window": 64, "layer_types": ["full_attention"] * 6 + ["sliding_attention"]},
         (0, 0, 0, 0, 0, 0, 64), None),
    ]
    for change, windows, kv_window in cases:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        loaded = load_config(tmp_path)
        assert (loaded.layer_windows, loaded.kv_window, loaded.context_limit) == (windows, kv_window, 512), change


def test_gemma3_local_layers_take_their_own_rope(tmp_path, tiny_llama_dir):
    from batchapi.engine.model.loader import Rope, load_config

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    gemma3 = {**config, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 2,
              "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
    older = {**gemma3, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear",
                                                                                        "factor": 8.0}}
    newer = {**gemma3, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    for raw in (older, newer):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        loaded = load_config(tmp_path)
        assert (loaded.rope_theta, loaded.rope_scaling["factor"]) == (1e6, 8.0)
        assert (loaded.local_rope, loaded.local_layers) == (Rope(1e4, None), frozenset({0}))


def test_dynamic_rope_runs_within_the_trained_context_only(tmp_path, smollm2_dir):
    from tests.utils.tiny_models import build_tiny_model

    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model_dir = build_tiny_model(tmp_path / "dynamic", smollm2_dir, "llama", rope_parameters=dynamic)
    prompts = tokenize(model_dir, PROMPTS[:2])
    assert [r.outputs[0].token_ids for r in run(engine_for(model_dir), prompts, greedy(8))] == \
        hf_greedy(model_dir, prompts, 8)
    with pytest.raises(UnsupportedModelError, match="max_model_len 1024 passes the model's 512 positions"):
        engine_for(model_dir, max_model_len=1024)

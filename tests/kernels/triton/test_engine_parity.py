"""The engine's greedy outputs with the twins, with the Triton kernels (interpreted) and from HF.

Here, not in the suite's process, because the Triton kernels need the interpreter (conftest.py).

A tiny random Llama (GQA 3, llama3 rope scaling, untied head) in fp32: the interpreter cannot do
bf16, and fp32 keeps all three bit-close, so the greedy tokens must be identical. And a tiny random
Qwen3-MoE (q/k norm through the Triton norm, yarn rope, a sparse and a dense layer). And a tiny Gemma 2
(a local layer with an 8-token window and a global one, both logit soft-caps, GELU-tanh) and Gemma 3
(q/k norm, the local layers' rope base, linear rope on the global layer). And a tiny Mixtral whose
every layer has an 8-token window: its blocks past the window are released while it generates.
"""

import random

import pytest
import torch

from tests.kernels.random_model import build_random_llama

TINY = dict(
    hidden_size=384, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
    head_dim=64, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
)
NEW_TOKENS = 6


MOE = dict(
    TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
)


GEMMA2 = dict(TINY, query_pre_attn_scalar=48, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
              attn_logit_softcapping=3.0, final_logit_softcapping=5.0, rope_parameters={"rope_type": "default",
                                                                                         "rope_theta": 10000.0})
MIXTRAL = dict(TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
GEMMA3 = dict(GEMMA2, attn_logit_softcapping=None, final_logit_softcapping=None, rope_parameters={
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}})


def _families():
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    return {"llama": (TINY, LlamaConfig, LlamaForCausalLM), "qwen3_moe": (MOE, Qwen3MoeConfig, Qwen3MoeForCausalLM),
            "mixtral": (MIXTRAL, MixtralConfig, MixtralForCausalLM),
            "gemma2": (GEMMA2, Gemma2Config, Gemma2ForCausalLM),
            "gemma3": (GEMMA3, Gemma3TextConfig, Gemma3ForCausalLM)}


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "mixtral", "gemma2", "gemma3"])
def tiny_model(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(f"tiny-random-{request.param}")
    shape, config_class, model_class = _families()[request.param]
    model = build_random_llama(shape, out, "cpu", torch.float32, std=0.08, config_class=config_class,
                               model_class=model_class)
    if request.param.startswith("gemma"):  # transformers' SDPA path has no soft-cap; norms (1 + w) with w not 0
        model.set_attn_implementation("eager")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
        model.save_pretrained(out, safe_serialization=True)
    rng = random.Random(0)
    # two prompts share a 20-token prefix: the second runs after the first, as a prefill on a cached block
    shared = [rng.randrange(2, 512) for _ in range(20)]
    prompts = [shared + [5, 6, 7], shared + [9], [rng.randrange(2, 512) for _ in range(29)], [3]]
    reference = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        reference.append(gen[0, len(prompt):].tolist())
    return out, prompts, reference


def _engine_greedy(model_dir, prompts, kernels):
    from batchapi.engine import EngineConfig, EngineFront, GenerationRequest, SamplingParams

    config = EngineConfig(model_path=model_dir, device="cpu", dtype="float32", kernels=kernels,
                          max_num_seqs=8, max_num_batched_tokens=16, kv_cache_bytes=8 << 20)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with EngineFront(config) as front:  # a 16-token budget chunks the 29-token prompt across steps
        first = front.submit(GenerationRequest("r0", prompts[0], params)).result(timeout=300)
        futures = [front.submit(GenerationRequest(f"r{i}", p, params)) for i, p in enumerate(prompts) if i]
        results = [first] + [f.result(timeout=300) for f in futures]
    assert all(r.error is None for r in results), [r.error for r in results]
    assert results[1].cached_tokens >= 16, "the second prompt should start on the first one's cached block"
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_engine_greedy_matches_hf(tiny_model, kernels):
    model_dir, prompts, reference = tiny_model
    assert _engine_greedy(model_dir, prompts, kernels) == reference

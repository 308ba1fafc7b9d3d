"""The pure-torch twins against plain dense attention and against transformers' Llama modules."""

import random

import pytest
import torch

from batchapi.kernels import attention_ref, reference
from batchapi.kernels.rope import build_rope_cache
from tests.kernels.paged import dense_attention, make_case

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _random_lens(rng: random.Random, num_seqs: int, max_ctx: int):
    q_lens, ctx_lens = [], []
    for _ in range(num_seqs):
        ctx = rng.randint(1, max_ctx)
        kind = rng.choice(["decode", "prefill", "chunk"])
        q = 1 if kind == "decode" else ctx if kind == "prefill" else rng.randint(1, ctx)
        q_lens.append(q)
        ctx_lens.append(ctx)
    return q_lens, ctx_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_twin_matches_dense(seed, dtype):
    rng = random.Random(seed)
    hkv, group = rng.choice([(1, 1), (2, 3), (1, 5), (3, 3), (2, 4)])
    d = rng.choice([64, 128])
    q_lens, ctx_lens = _random_lens(rng, rng.randint(1, 6), 70)
    case = make_case(q_lens, ctx_lens, hkv * group, hkv, d, block_size=rng.choice([8, 16]), dtype=dtype, seed=seed)
    out = attention_ref.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_attention_twin_all_decode_and_huge_block_ids():
    q_lens = [1] * 5
    ctx_lens = [1, 16, 17, 40, 33]
    # about 2^31 / (16 * 64) blocks: element offsets of the top ids exceed int32
    case = make_case(q_lens, ctx_lens, 2, 1, 64, dtype=torch.float16, num_blocks=2_200_000)
    out = attention_ref.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_twin_decode_in_length_buckets(dtype):
    # contexts 1..600 split into several buckets, each padded to its own longest context
    rng = random.Random(7)
    ctx_lens = [rng.randint(1, 600) for _ in range(40)]
    assert len(attention_ref._bucket_bounds(sorted(ctx_lens, reverse=True))) > 3
    case = make_case([1] * len(ctx_lens), ctx_lens, 6, 2, 64, dtype=dtype, seed=7)
    out = attention_ref.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])


def test_store_kvcache_skips_negative_slots():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reference.store_kvcache(key, value, k_cache, v_cache, torch.tensor([13, -1, 2], dtype=torch.int32))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[0, 2], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, **kw)


@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}],
)
def test_rope_and_rotary_match_transformers(rope_scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    theta = 500000.0
    params = {"rope_type": "default", "rope_theta": theta} if rope_scaling is None else {**rope_scaling, "rope_theta": theta}
    hf = LlamaRotaryEmbedding(_llama_config(rope_parameters=params, max_position_embeddings=512))
    cos_sin = build_rope_cache(64, 512, theta, rope_scaling, "cpu", torch.float32)
    positions = torch.tensor([0, 1, 7, 300, 511])
    q, k = torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    cos, sin = hf(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = reference.rotary(q, k, positions, cos_sin)
    assert torch.equal(cos_sin[positions, :32], cos[0, :, :32])
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_mlp_match_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    norm = LlamaRMSNorm(128, eps=1e-5).to(dtype)
    norm.weight.data.normal_()
    x, res = torch.randn(7, 128).to(dtype), torch.randn(7, 128).to(dtype)
    assert torch.equal(reference.rms_norm(x, norm.weight, 1e-5), norm(x))
    normed, summed = reference.fused_add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(summed, x + res) and torch.equal(normed, norm(x + res))

    mlp = LlamaMLP(_llama_config()).to(dtype)
    h = torch.randn(7, 128).to(dtype)
    gate_up = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)  # [N, 2I]
    expected = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
    assert torch.equal(reference.silu_and_mul(gate_up), expected)

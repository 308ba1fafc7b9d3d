"""The Triton store/norm/rotary/activation kernels (interpreted on CPU) against their twins.

Tolerances: fp32 1e-5 and fp16 1e-3, from reduction order and exp/rsqrt implementations; the
kernels round at the same places as the twins, so most results are bit-equal.
"""

import random

import pytest
import torch

from batchapi.kernels import CPU_OPS, TORCH_OPS, build_rope_cache, get_ops

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.fixture(scope="module")
def triton_ops():
    return get_ops("triton", "cpu")


def test_get_ops_modes(triton_ops):
    assert get_ops("auto", "cpu") is CPU_OPS and get_ops("torch", "cuda") is TORCH_OPS
    with pytest.raises(AssertionError, match="kernel mode cpu runs on CPU tensors"):
        get_ops("cpu", "cuda")
    assert triton_ops.name == "triton"
    with pytest.raises(AssertionError, match="kernel mode"):
        get_ops("cuda", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(2))
def test_norms_match_twin(triton_ops, seed, dtype):
    rng = random.Random(seed)
    n, hidden = rng.randint(1, 6), rng.choice([64, 96, 576])
    x, res, w = torch.randn(n, hidden).to(dtype), torch.randn(n, hidden).to(dtype), torch.randn(hidden).to(dtype)
    tol = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), TORCH_OPS.rms_norm(x, w, 1e-5), **tol)
    normed, summed = triton_ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_summed = TORCH_OPS.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(normed, ref_normed, **tol)
    assert torch.equal(summed, ref_summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_twin(triton_ops, dtype):
    x = torch.randn(3, 2 * 1500).to(dtype)  # two column blocks, the second ragged
    torch.testing.assert_close(triton_ops.silu_and_mul(x), TORCH_OPS.silu_and_mul(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}])
def test_rotary_matches_twin_on_qkv_views(triton_ops, dtype, scaling):
    hq, hkv, d, n = 5, 1, 64, 4
    cos_sin = build_rope_cache(d, 4096, 500000.0, scaling, "cpu", torch.float32)
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)  # the engine's fused projection, split by views
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    positions = torch.tensor([0, 1, 1000, 4095])
    for out, ref in zip(triton_ops.rotary(q, k, positions, cos_sin), TORCH_OPS.rotary(q, k, positions, cos_sin),
                        strict=True):
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_matches_twin(triton_ops, dtype):
    g = torch.Generator().manual_seed(0)
    n, hkv, d = 6, 3, 64
    kv = torch.randn(n, 2 * hkv * d, generator=g).to(dtype)
    key, value = kv[:, : hkv * d].view(n, hkv, d), kv[:, hkv * d :].view(n, hkv, d)
    slots = torch.tensor([5, -1, 160, 31, -1, 17], dtype=torch.int64)
    caches = [torch.zeros(11, 16, hkv, d, dtype=dtype) for _ in range(4)]
    triton_ops.store_kvcache(key, value, caches[0], caches[1], slots)
    TORCH_OPS.store_kvcache(key, value, caches[2], caches[3], slots.int())
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int(caches[0].count_nonzero()) == 4 * hkv * d

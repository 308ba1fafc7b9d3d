"""The Triton paged-attention kernel (kernels.triton.attention, interpreted on CPU) against its twin,
and with a sliding window and a soft-cap against dense attention.

Sizes stay small: the interpreter runs each program instance in numpy (about 0.4 ms each) and
cannot do bf16 arithmetic, so the dtypes are fp32 and fp16.
Tolerances: fp32 1e-5 (summation order only), fp16 3e-3 (P rounded to fp16 before P @ V, output
rounded to fp16; values are O(1)).
"""

import dataclasses
import random

import pytest
import torch

from batchapi.kernels.torch import attention as twin
from batchapi.kernels.triton import attention
from tests.kernels.paged import dense_attention, make_case

# float32: the kernel's reductions and torch's dense oracle (whose summation order follows the CPU's
# BLAS kernels: AVX2 and AVX-512 machines differ) part by a few ulps over windows of 100 positions
TOL = {torch.float32: 3e-5, torch.float16: 3e-3}
GQA = [(1, 1), (2, 3), (1, 5), (2, 4), (3, 3)]  # (Hkv, group)


def _mixed_lens(rng: random.Random, num_seqs: int, max_ctx: int):
    """A step like the engine's: decodes, whole prefills and chunks on top of a cached prefix."""
    q_lens, ctx_lens = [], []
    for i in range(num_seqs):
        ctx = rng.randint(1, max_ctx)
        kind = ["decode", "prefill", "chunk"][i % 3] if i < 3 else rng.choice(["decode", "prefill", "chunk"])
        q_lens.append(1 if kind == "decode" else ctx if kind == "prefill" else rng.randint(1, ctx))
        ctx_lens.append(ctx)
    return q_lens, ctx_lens


def _check(case, dtype, **kwargs):
    out = attention.paged_attention(*case.args(), case.scale, **kwargs)
    expected = twin.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_step_matches_twin(seed, dtype):
    rng = random.Random(seed)
    hkv, group = GQA[seed % len(GQA)] if dtype == torch.float32 else rng.choice(GQA)
    d = [64, 128][seed % 2]
    q_lens, ctx_lens = _mixed_lens(rng, rng.randint(3, 5), 40)
    case = make_case(q_lens, ctx_lens, hkv * group, hkv, d, block_size=rng.choice([8, 16, 32]), dtype=dtype, seed=seed)
    _check(case, dtype)


@pytest.mark.parametrize(("hkv", "group"), [(2, 7), (1, 8), (1, 16)])  # Qwen2.5-0.5B's 14/2; wide groups
def test_wide_and_odd_groups_match_twin(hkv, group):
    case = make_case([1, 7, 1], [19, 12, 33], hkv * group, hkv, 64, seed=group)
    _check(case, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_matches_twin(num_splits):
    rng = random.Random(num_splits)
    q_lens, ctx_lens = [1, 1, 1], [rng.randint(30, 90) for _ in range(3)]
    case = make_case(q_lens, ctx_lens, 5, 1, 64, dtype=torch.float16, seed=num_splits)
    _check(case, torch.float16, num_splits=num_splits)


def test_split_kv_handles_prefill_rows():
    # the split path is general: slices a causal row never sees must merge as empty
    case = make_case([1, 9], [40, 20], 3, 1, 64, seed=5)
    _check(case, torch.float32, num_splits=4)


def test_huge_block_ids_do_not_overflow():
    # ids near 2.2M with 1 KiB-element blocks put element offsets past 2^31 (caches are torch.empty,
    # so only the used blocks take memory)
    case = make_case([1, 1, 3], [17, 5, 20], 2, 1, 64, dtype=torch.float16, num_blocks=2_200_000, seed=7)
    assert int(case.block_tables.max()) * case.k_cache.stride(0) > 2**31
    _check(case, torch.float16)


def test_twin_and_kernel_match_dense_on_block_edges():
    # contexts one below, at and one above a block boundary; prefill exactly one block
    case = make_case([1, 1, 1, 16, 2], [15, 16, 17, 16, 33], 4, 2, 64, block_size=16, seed=3)
    expected = dense_attention(case)
    for fn in (attention.paged_attention, twin.paged_attention):
        torch.testing.assert_close(fn(*case.args(), case.scale), expected, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_inputs():
    case = make_case([1], [5], 2, 1, 64)
    with pytest.raises(AssertionError, match="int32"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables.long(),
                                  case.cu_seqlens_q, case.context_lens, case.scale)
    with pytest.raises(AssertionError, match="dtypes"):
        attention.paged_attention(case.q.half(), *case.args()[1:], case.scale)
    with pytest.raises(AssertionError, match="multiple"):
        attention.paged_attention(torch.zeros(1, 3, 64), *make_case([1], [5], 2, 2, 64).args()[1:], case.scale)
    with pytest.raises(AssertionError, match="window"):
        attention.paged_attention(*case.args(), case.scale, window=-1)


def test_host_hints_change_nothing_but_the_launch():
    # the engine may pass the step's maxima it knows on the host; wrong-but-valid tilings stay exact
    case = make_case([1, 6, 1], [30, 6, 12], 4, 2, 64, seed=4)
    expected = twin.paged_attention(*case.args(), case.scale, max_seqlen_q=6, max_context_len=30)
    for hints in ({"max_seqlen_q": 6, "max_context_len": 30}, {"max_seqlen_q": 1, "max_context_len": 30}):
        out = attention.paged_attention(*case.args(), case.scale, **hints)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _windowed(q_lens, ctx_lens, hkv, group, window, freed, dtype, seed, d=32):
    """A case with 8-slot blocks whose queries are scaled up so that a soft-cap of 30 bends the scores."""
    case = make_case(q_lens, ctx_lens, hkv * group, hkv, d, block_size=8, dtype=dtype, seed=seed, window=window,
                     freed=freed)
    return dataclasses.replace(case, q=case.q * 20)


# a window below a block, one that ends mid-block, one past a decode tile (32), one past every context
@pytest.mark.parametrize("window", [5, 12, 40, 100])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_window_and_softcap_match_dense_and_twin(window, softcap):
    for dtype, freed, (hkv, group) in ((torch.float32, "-1", (2, 3)), (torch.float16, "nan", (1, 5))):
        # decodes, a chunk and a prefill on a cached prefix, a whole prefill; then a step of decodes alone
        for q_lens, ctx_lens in (([1, 7, 20, 1, 12], [50, 30, 20, 9, 40]), ([1, 1, 1], [47, 8, 30])):
            case = _windowed(q_lens, ctx_lens, hkv, group, window, freed, dtype, seed=window)
            kwargs = dict(window=window, softcap=softcap)
            expected = (dense_attention(case, softcap), twin.paged_attention(*case.args(), case.scale, **kwargs))
            for invariant in (False, True):  # the invariant tiling is the decode one for every row
                out = attention.paged_attention(*case.args(), case.scale, invariant=invariant, **kwargs)
                for oracle in expected:
                    torch.testing.assert_close(out, oracle, atol=TOL[dtype], rtol=TOL[dtype])


def test_a_window_past_the_context_changes_no_bit():
    case = make_case([1, 7, 20], [50, 30, 20], 4, 2, 32, block_size=8, seed=1)
    assert torch.equal(attention.paged_attention(*case.args(), case.scale, window=50),
                       attention.paged_attention(*case.args(), case.scale))


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_splits_the_window(num_splits):
    # long decodes whose freed blocks hold NaN; a short prefill whose window starts at 0
    case = _windowed([1, 1, 6, 1], [90, 61, 6, 20], 2, 2, 21, "nan", torch.float32, seed=num_splits)
    for softcap in (0.0, 30.0):
        out = attention.paged_attention(*case.args(), case.scale, window=21, softcap=softcap, num_splits=num_splits)
        torch.testing.assert_close(out, dense_attention(case, softcap), atol=1e-5, rtol=1e-5)


def test_gemma_head_dim_256_with_window_and_softcap_matches_dense():
    # D=256 has a prefill tiling of its own (32 x 32 tiles): a prefill on a cached prefix and a decode
    # (fp32 dot products of 256 terms summed in another order than the dense oracle's: a few times
    # the error of D=64, 2e-5 seen on an AMD EPYC)
    case = _windowed([9, 1], [20, 30], 2, 2, 7, "nan", torch.float32, seed=2, d=256)
    for softcap in (0.0, 50.0):
        out = attention.paged_attention(*case.args(), case.scale, window=7, softcap=softcap)
        torch.testing.assert_close(out, dense_attention(case, softcap), atol=5e-5, rtol=5e-5)

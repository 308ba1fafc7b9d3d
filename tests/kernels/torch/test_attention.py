"""The twin paged attention (kernels.torch.attention) against plain dense attention."""

import random

import pytest
import torch

from batchapi.kernels.torch import attention
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
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_attention_twin_all_decode_and_huge_block_ids():
    q_lens = [1] * 5
    ctx_lens = [1, 16, 17, 40, 33]
    # about 2^31 / (16 * 64) blocks: element offsets of the top ids exceed int32
    case = make_case(q_lens, ctx_lens, 2, 1, 64, dtype=torch.float16, num_blocks=2_200_000)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_twin_decode_in_length_buckets(dtype):
    # contexts 1..600 split into several buckets, each padded to its own longest context
    rng = random.Random(7)
    ctx_lens = [rng.randint(1, 600) for _ in range(40)]
    assert len(attention._bucket_bounds(sorted(ctx_lens, reverse=True))) > 3
    case = make_case([1] * len(ctx_lens), ctx_lens, 6, 2, 64, dtype=dtype, seed=7)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])


# sliding windows: none, shorter than a block, ending mid-block, longer than every context
WINDOWS = [0, 5, 21, 1000]


def windowed_case(window: int, softcap: float, dtype: torch.dtype, freed: str, block_size: int = 16):
    """Decode rows (one that pads a bucket beside longer ones), a whole prompt, chunks on a cached
    prefix, a long run; 3 query heads a KV head. With a soft cap, q is scaled so that the scores
    reach where tanh bends them."""
    q_lens = [1, 1, 1, 9, 30, 12, 70]
    ctx_lens = [50, 3, 130, 9, 30, 100, 150]
    case = make_case(q_lens, ctx_lens, 6, 2, 64, block_size=block_size, dtype=dtype, seed=window, window=window,
                     freed=freed)
    if softcap:
        case.q.mul_(10.0)
    return case


@pytest.mark.parametrize(("dtype", "freed"), [(torch.float32, "nan"), (torch.bfloat16, "-1")])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_and_soft_capped_attention_matches_dense(window, softcap, dtype, freed):
    # the blocks before each sequence's window are freed: -1 in the table, or another's (NaN)
    case = windowed_case(window, softcap, dtype, freed)
    expected = dense_attention(case, softcap=softcap)
    for fn in (attention.paged_attention, attention.invariant_paged_attention):
        out = fn(*case.args(), case.scale, window=window, softcap=softcap)
        assert not out.isnan().any(), f"{fn.__name__} read a freed block"
        torch.testing.assert_close(out, expected, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


def test_the_soft_cap_bends_the_scores():
    case = windowed_case(0, 30.0, torch.float32, "")
    assert not torch.allclose(dense_attention(case, softcap=30.0), dense_attention(case), atol=1e-2)


def test_soft_capped_prefill_in_several_row_blocks(monkeypatch):
    monkeypatch.setattr(attention, "CAPPED_ROWS", 16)  # the 70- and 30-token runs in blocks of 16 query rows
    case = windowed_case(21, 30.0, torch.float32, "nan")
    out = attention.paged_attention(*case.args(), case.scale, window=21, softcap=30.0)
    torch.testing.assert_close(out, dense_attention(case, softcap=30.0), atol=4e-5, rtol=4e-5)


def test_layers_that_alternate_windowed_and_global_attention_each_get_their_plan():
    # Gemma 3: sliding layers and global ones in one step, over the same metadata tensors
    case = windowed_case(0, 0.0, torch.float32, "")
    for window in (21, 0, 21, 5, 0):
        out = attention.paged_attention(*case.args(), case.scale, window=window)
        case.window = window
        torch.testing.assert_close(out, dense_attention(case), atol=TOL[torch.float32], rtol=TOL[torch.float32])

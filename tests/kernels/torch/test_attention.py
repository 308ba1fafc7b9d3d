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

"""Batch invariance of the Triton kernels (interpreted on CPU, fp32 and fp16): the attention with
invariant=True gives a token the same bits in every kind of step, and the fixed-tile matmul gives a
row the same bits whatever the row count.

The interpreter's tl.dot is numpy's matmul, whose BLAS gives a row other bits by its position in
the tile (seen here: rows 6-15 of a 16-row dot), which a GPU's MMA does not: each output element
is summed in k order by the same instructions. So these tests run with the interpreter's dot
replaced by one that sums every element in k order; what they check is the kernels' structure
(tiles, splits, masks, the order of the K loop). Compiled on a GPU they are for bench/gpu_check.py.
"""

import numpy as np
import pytest
import torch
from triton.runtime import interpreter

from batchapi.kernels.triton import attention, matmul
from tests.kernels.invariance import check_attention
from tests.kernels.paged import dense_attention, make_case


@pytest.fixture(autouse=True)
def dot_in_k_order(monkeypatch):
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.copy()
        x, y = a.data.astype(acc.dtype), b.data.astype(acc.dtype)  # fp16 products are exact in fp32
        for k in range(x.shape[-1]):
            acc += x[..., :, k : k + 1] * y[..., k : k + 1, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    assert np  # numpy arrays are what the interpreter's handles hold


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_invariant_attention_is_invariant(dtype):
    def invariant(*args, **kwargs):
        return attention.paged_attention(*args, invariant=True, **kwargs)

    check_attention(invariant, dtype, hq=3, hkv=1, d=32, block_size=16, context=40)


# windows whose starts cross a 32-key tile inside a program of 5 positions: in the prefill, rows
# 40-44 (window 13) and 50-54 (window 20) start their windows in tiles 0 and 1, the last of them in
# tile 1 alone; the other sequences' blocks before their windows are freed (NaN)
@pytest.mark.parametrize(("window", "softcap"), [(13, 0.0), (20, 30.0)])
def test_the_invariant_attention_is_invariant_with_a_window(window, softcap):
    def invariant(*args, **kwargs):
        return attention.paged_attention(*args, invariant=True, **kwargs)

    check_attention(invariant, torch.float32, hq=3, hkv=1, d=32, block_size=16, context=60, window=window,
                    softcap=softcap)


@pytest.mark.parametrize("freed", ["-1", "nan"])
def test_the_invariant_attention_with_a_window_skips_the_freed_blocks(freed):
    # the last 12 of 60 tokens, window 13: blocks 0-3 (keys 0-31) lie before every query's window
    # and are freed; the run whole, token by token and in chunks of 5, each call's table the same
    case = make_case([12], [60], 3, 1, 32, block_size=8, seed=3, window=13, freed=freed)

    def run(lo: int, n: int) -> torch.Tensor:
        cu = torch.tensor([0, n], dtype=torch.int32)
        lens = torch.tensor([48 + lo + n], dtype=torch.int32)
        return attention.paged_attention(case.q[lo : lo + n], case.k_cache, case.v_cache, case.block_tables, cu,
                                         lens, case.scale, window=13, invariant=True)

    whole = run(0, 12)
    torch.testing.assert_close(whole, dense_attention(case), atol=1e-5, rtol=1e-5)
    for chunk in (1, 5):
        assert torch.equal(torch.cat([run(lo, min(chunk, 12 - lo)) for lo in range(0, 12, chunk)]), whole), chunk


def test_the_invariant_attention_ignores_the_split_and_tiling_hints():
    case = make_case([1, 1, 9], [80, 70, 20], 3, 1, 32, seed=2)
    plain = attention.paged_attention(*case.args(), case.scale, invariant=True)
    hinted = attention.paged_attention(*case.args(), case.scale, invariant=True, num_splits=4, max_seqlen_q=9,
                                       max_context_len=80)
    assert torch.equal(plain, hinted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_matmul_matches_torch_and_is_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=g).to(dtype)
    bias = torch.randn(200, generator=g).to(dtype)
    x = torch.randn(150, 96, generator=g).to(dtype)
    full = matmul.linear(x, weight, bias)
    expected = x.float() @ weight.float().T + bias.float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), expected, atol=tol, rtol=tol)
    for m in (1, 2, 63, 64, 65, 129):
        for start in (0, 150 - m):
            assert torch.equal(matmul.linear(x[start : start + m], weight, bias), full[start : start + m]), m
    assert matmul.linear(x[:0], weight).shape == (0, 200)

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
    def invariant(*args):
        return attention.paged_attention(*args, invariant=True)

    check_attention(invariant, dtype, hq=3, hkv=1, d=32, block_size=16, context=40)


def test_the_invariant_attention_ignores_the_split_and_tiling_hints():
    from tests.kernels.paged import make_case

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

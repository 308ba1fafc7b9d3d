"""The bf16-stored linear in C (kernels.cpu.matmul): F.linear's values, and a row's bits the same at
every row count, offset, thread count and in every build."""

import pytest
import torch
import torch.nn.functional as F

from batchapi.kernels.cpu import build, matmul
from tests.kernels.march import build_for

SHAPES = [(1, 1), (37, 19), (160, 96), (200, 257)]  # (out, in): panels of 16 with a ragged last one, odd K


def layer(out_features: int, in_features: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16().float()  # exact in bf16
    b = torch.randn(out_features, generator=generator) if bias else None
    return weight, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_values_of_f_linear_and_the_same_bits_at_every_row_count(out_features, in_features, bias):
    weight, b = layer(out_features, in_features, bias)
    packed = matmul.pack(weight)
    x = torch.randn(203, in_features)
    full = matmul.linear(x, packed, out_features, b)
    torch.testing.assert_close(full, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 5, 6, 7, 13, 96, 97, 202):
        for start in (0, 203 - rows, rows // 3):
            assert torch.equal(matmul.linear(x[start:start + rows], packed, out_features, b),
                               full[start:start + rows]), (rows, start)


def test_threads_rows_strides_and_leading_dimensions_change_no_bit():
    weight, b = layer(200, 257, True)
    packed = matmul.pack(weight)
    wide = torch.randn(64, 300)
    x = wide[:, 11:268]  # rows 300 floats apart, not contiguous
    full = matmul.linear(x.contiguous(), packed, 200, b)
    assert torch.equal(matmul.linear(x, packed, 200, b), full)
    assert torch.equal(matmul.linear(x.contiguous().view(8, 8, 257), packed, 200, b), full.view(8, 8, 200))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(matmul.linear(x, packed, 200, b), full)
    finally:
        torch.set_num_threads(threads)


def test_a_weight_or_bias_of_another_shape_is_refused():
    weight, b = layer(37, 19, True)
    packed = matmul.pack(weight)
    for bad in (lambda: matmul.linear(torch.randn(3, 18), packed, 37, b),  # another in_features
                lambda: matmul.linear(torch.randn(3, 19), packed, 37, b[:36]),  # a short bias
                lambda: matmul.linear(torch.randn(3, 19), packed, 49, None),  # more outputs than panels hold
                lambda: matmul.linear(torch.randn(3, 19), packed.float(), 37, None)):
        with pytest.raises(ValueError):
            bad()
    one = torch.randn(19, 1).T  # one row whose stride is 1: a row stride below in_features, unused
    assert torch.equal(matmul.linear(one, packed, 37, b), matmul.linear(one.contiguous(), packed, 37, b))


def test_pack_keeps_every_weight_and_only_bf16_exact_weights_qualify():
    weight, _ = layer(37, 19, False)
    assert matmul.pack(weight).shape == (3, 19, 16)  # 37 outputs in 3 panels of 16
    assert torch.equal(matmul.unpack(matmul.pack(weight), 37), weight)
    assert matmul.exact_in_bf16(weight)
    assert not matmul.exact_in_bf16(weight + 1e-3)  # float32 values bf16 would round
    assert not matmul.exact_in_bf16(weight.bfloat16())  # a bf16 layer multiplies in bf16 as it is


@pytest.mark.parametrize(("march", "needs"), [("x86-64", {"sse2"}), ("haswell", {"avx2", "fma"})])
def test_every_build_gives_the_same_bits(march, needs, tmp_path, monkeypatch):
    """Plain C (fmaf) and AVX2 with FMA sum each output in one order: a worker of either kind gives a
    row the bits of the native build."""
    weight, b = layer(200, 257, True)
    packed = matmul.pack(weight)
    x = torch.randn(21, 257)
    native = matmul.linear(x, packed, 200, b)
    if not build_for(march, needs, build.MATMUL_SOURCE, tmp_path, monkeypatch):
        return  # this CPU cannot run that build: it was built, not run
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(matmul, "_lib", None)
    portable = build.load_matmul()
    assert portable is not None and matmul._library() is portable
    assert torch.equal(matmul.linear(x, packed, 200, b), native)

"""The bf16-stored linear in C (kernels.cpu.matmul): F.linear's values, and a row's bits the same at
every row count, offset, thread count and in every build."""

import os
import subprocess
import sys
from pathlib import Path

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
    row the bits of the native build; the bf16 linear and its argmax too (plain C there: the bits of
    AVX512-BF16)."""
    weight, b = layer(200, 257, True)
    packed = matmul.pack(weight)
    x = torch.randn(21, 257)
    native = matmul.linear(x, packed, 200, b)
    pairs, x16, b16 = matmul.pack_pairs(weight), x.bfloat16(), b.bfloat16()
    native16 = matmul.linear_bf16(x16, pairs, 200, 257, b16)
    # the argmax: ties (small integers), then a NaN in column 37 (a NaN weight)
    small = torch.randint(-2, 3, (100, 64), generator=torch.Generator().manual_seed(1)).bfloat16()
    small_x = small[:21].flip(1).contiguous()
    with_nan = small.clone()
    with_nan[37, 5] = float("nan")
    argmax_cases = [(matmul.pack_pairs(w), matmul.linear_bf16(small_x, matmul.pack_pairs(w), 100, 64, None).argmax(-1))
                    for w in (small, with_nan)]
    if not build_for(march, needs, build.MATMUL_SOURCE, tmp_path, monkeypatch):
        return  # this CPU cannot run that build: it was built, not run
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(matmul, "_lib", None)
    portable = build.load_matmul()
    assert portable is not None and matmul._library() is portable
    assert torch.equal(matmul.linear(x, packed, 200, b), native)
    assert torch.equal(matmul.linear_argmax(x, packed, 200, b), native.argmax(-1))
    for packed16, chosen in argmax_cases:
        assert torch.equal(matmul.linear_bf16_argmax(small_x, packed16, 100, 64, None), chosen)
    assert not matmul.native_bf16() and torch.equal(matmul.linear_bf16(x16, pairs, 200, 257, b16), native16)


# the bf16 linear for AVX512-BF16 (linear_bf16): on a CPU without it, the plain-C build does the same
# operations, so every test here runs everywhere and checks the bits AVX512-BF16 gives


def flushed(t: torch.Tensor) -> torch.Tensor:
    """Denormals read as zero (of their sign), as VDPBF16PS reads its inputs and writes its sums."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(t).copysign(t), t)


def dpbf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What VDPBF16PS sums, one pair at a time: the odd element's product fused into the sum, then the
    even one's, each rounded to float32 (a product of two bf16 is exact in float32, and the float64
    sum of two float32 values rounds to float32 as a fused multiply-add does); + bias; bf16."""
    xs, ws = flushed(x.float()).double(), flushed(weight.float()).double()
    if xs.shape[1] % 2:
        xs, ws = F.pad(xs, (0, 1)), F.pad(ws, (0, 1))
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for i in range(0, xs.shape[1], 2):
        for j in (i + 1, i):
            acc = flushed((acc.double() + xs[:, j:j + 1] * ws[:, j]).float())
    out = acc + bias.float() if bias is not None else acc
    return flushed(out).bfloat16()


@pytest.fixture(params=matmul.INSTRUCTIONS)
def instructions(request):
    """``linear_bf16`` on each of its instructions, for the test, then back to the process's choice.
    The plain-C build has one way (it stays "dpbf16")."""
    before = matmul.bf16_instructions()
    try:
        now = matmul.bf16_instructions(request.param)
        assert now == (request.param if matmul.native_bf16() else "dpbf16")
        yield now
    finally:
        matmul.bf16_instructions(before)


def test_the_bf16_instructions_come_from_the_environment_or_are_timed(monkeypatch, caplog):
    before = matmul.bf16_instructions()
    lib = matmul._library()
    try:
        for wanted in matmul.INSTRUCTIONS:
            monkeypatch.setenv(matmul.INSTRUCTIONS_ENV, wanted)
            matmul._choose_instructions(lib)
            assert matmul.bf16_instructions() == (wanted if matmul.native_bf16() else "dpbf16")
        monkeypatch.setenv(matmul.INSTRUCTIONS_ENV, "avx")
        with caplog.at_level("INFO", logger=matmul.__name__):
            matmul._choose_instructions(lib)
        assert "is none of auto, dpbf16, fma" in caplog.text and "a test layer" in caplog.text
        assert matmul.bf16_instructions() in caplog.text.split("bf16 linear layers on ")[1]
        with pytest.raises(ValueError, match="not 'avx'"):
            matmul.bf16_instructions("avx")
    finally:
        matmul.bf16_instructions(before)


def bf16_layer(out_features: int, in_features: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    return weight, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), [*SHAPES, (100, 64)])  # ragged last group of panels
def test_bf16_linear_sums_as_avx512_bf16_does_and_gives_the_same_bits_at_every_row_count(out_features, in_features,
                                                                                       bias, instructions):
    weight, b = bf16_layer(out_features, in_features, bias)
    packed = matmul.pack_pairs(weight)
    x = torch.randn(203, in_features).bfloat16()
    x[5] *= 1e-38  # denormal products and sums: flushed
    full = matmul.linear_bf16(x, packed, out_features, in_features, b)
    assert torch.equal(full, dpbf16_reference(x, weight, b))
    torch.testing.assert_close(full.float(), F.linear(x.float(), weight.float(), None if b is None else b.float()),
                               rtol=1e-2, atol=0.1)
    for rows in (1, 2, 4, 5, 6, 7, 8, 9, 17, 96, 97, 202):  # a last row tile of every size 1-8
        for start in (0, 203 - rows, rows // 3):
            assert torch.equal(matmul.linear_bf16(x[start:start + rows], packed, out_features, in_features, b),
                               full[start:start + rows]), (rows, start)


def test_bf16_linear_rounds_at_the_smallest_normal_as_avx512_bf16_does(instructions):
    """Sums about FLT_MIN (2^-126), each pair's odd element first: 2^-126 - 2^-151 rounds to 2^-126, a
    normal number, kept (a CPU judging tininess before rounding would flush it); 2^-126 - 2^-149 is
    denormal, flushed; a denormal weight reads as zero; a denormal bias is added as it is (2^-126 -
    2^-140: denormal, flushed), and a denormal output is written as zero of its sign."""
    tiny = 2.0**-126
    x = torch.tensor([[2.0**-75, 1.0, 2.0**10, 0.0]]).bfloat16()  # pairs (even, odd): (2^-75, 1), (2^10, 0)
    weight = torch.zeros(16, 4)
    weight[0] = torch.tensor([-(2.0**-76), tiny, 0.0, 0.0])  # 2^-126, then + -2^-151
    weight[1] = torch.tensor([-(2.0**-74), tiny, 0.0, 0.0])  # 2^-126, then + -2^-149
    weight[2] = torch.tensor([0.0, 0.0, 2.0**-130, 0.0])  # 2^10 * a denormal: 2^-120 if it were read
    weight[3] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    weight = weight.bfloat16()
    b = torch.zeros(16)
    b[0] = -(2.0**-140)
    b[4:] = torch.tensor([2.0**-140, -(2.0**-140), 2.0**-127, 1.0] * 3)
    packed = matmul.pack_pairs(weight)
    plain = matmul.linear_bf16(x, packed, 16, 4, None)
    assert plain[0, :4].tolist() == [tiny, 0.0, 0.0, 2.0**-75]
    biased = matmul.linear_bf16(x, packed, 16, 4, matmul.panel_bias(b, 16))
    assert biased[0, 0].item() == 0.0 and biased[0, 4:8].view(torch.int16).tolist() == [0, -32768, 0, 0x3F80]
    for bias, got in ((None, plain), (b, biased)):
        assert torch.equal(got.view(torch.int16), dpbf16_reference(x, weight, bias).view(torch.int16))


def test_both_bf16_instructions_give_the_same_nan_and_infinity_bits():
    """NaNs of either sign and of another payload, infinities and infinity times zero in x and in the
    weights: VDPBF16PS and the FMAs give the same bits (where the kernel runs the FMAs; else one path)."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 40, generator=g).bfloat16(), torch.randn(20, 40, generator=g).bfloat16()
    x[1, 3], x[2, 4], x[3, 5], x[4, 8] = float("nan"), float("inf"), -float("inf"), -float("nan")
    x[5, 10] = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)[0]  # another payload
    weight[7, 5], weight[9, 3], weight[11, 8], weight[12, 4] = 0.0, float("nan"), -float("nan"), float("inf")
    packed = matmul.pack_pairs(weight)
    before = matmul.bf16_instructions()
    try:
        outputs = [(matmul.bf16_instructions(name), matmul.linear_bf16(x, packed, 64, 40, None).view(torch.int16))
                   for name in matmul.INSTRUCTIONS]
    finally:
        matmul.bf16_instructions(before)
    assert outputs[1][0] == ("fma" if matmul.native_bf16() else "dpbf16")
    assert torch.isnan(outputs[0][1].view(torch.bfloat16)).sum() > 100
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_the_callers_rounding_mode_changes_no_sum(instructions):
    """VDPBF16PS rounds to nearest even whatever MXCSR says; the FMAs set it so for their sums: a caller
    rounding toward zero (fesetround, on its own thread: one torch thread) gets the same bits."""
    import ctypes

    weight, _ = bf16_layer(256, 1536, False)
    packed = matmul.pack_pairs(weight)
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(2)).bfloat16()
    libm, threads = ctypes.CDLL("libm.so.6"), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        nearest = matmul.linear_bf16(x, packed, 256, 1536, None)
        third = torch.ones(1) / 3
        assert libm.fesetround(0xC00) == 0  # FE_TOWARDZERO on x86
        assert not torch.equal(torch.ones(1) / 3, third)  # this thread's sums now round toward zero
        toward_zero = matmul.linear_bf16(x, packed, 256, 1536, None)
    finally:
        libm.fesetround(0)  # FE_TONEAREST
        torch.set_num_threads(threads)
    assert torch.equal(toward_zero.view(torch.int16), nearest.view(torch.int16))


def test_bf16_linear_threads_strides_and_leading_dimensions_change_no_bit(instructions):
    weight, b = bf16_layer(200, 257, True)
    packed = matmul.pack_pairs(weight)
    x = torch.randn(64, 300).bfloat16()[:, 11:268]  # rows 300 apart, not contiguous
    full = matmul.linear_bf16(x.contiguous(), packed, 200, 257, b)
    assert torch.equal(matmul.linear_bf16(x, packed, 200, 257, b), full)
    assert torch.equal(matmul.linear_bf16(x, packed, 200, 257, matmul.panel_bias(b, 200)), full)  # made once, at load
    assert torch.equal(matmul.linear_bf16(x.contiguous().view(8, 8, 257), packed, 200, 257, b), full.view(8, 8, 200))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(matmul.linear_bf16(x, packed, 200, 257, b), full)
    finally:
        torch.set_num_threads(threads)


def test_bf16_linear_refuses_another_shape_or_dtype_and_packs_every_weight():
    weight, b = bf16_layer(37, 19, True)
    packed = matmul.pack_pairs(weight)
    assert packed.shape == (3, 10, 16) and packed.dtype == torch.int32  # 3 panels of 16, 10 pairs (odd K)
    assert torch.equal(matmul.unpack_pairs(packed, 37, 19), weight)
    for bad in (lambda: matmul.linear_bf16(torch.randn(3, 20).bfloat16(), packed, 37, 19, b),  # another in_features
                lambda: matmul.linear_bf16(torch.randn(3, 19).bfloat16(), packed, 37, 19, b[:36]),  # a short bias
                lambda: matmul.linear_bf16(torch.randn(3, 19).bfloat16(), packed, 49, 19, None),  # past the panels
                lambda: matmul.linear_bf16(torch.randn(3, 19), packed, 37, 19, b)):  # float32 activations
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(100, 64, True), (960, 576, False), (17, 32, True)])
def test_amx_linear_gives_f_linears_values_and_the_same_bits_at_every_row_count_offset_and_thread_count(
        out_features, in_features, bias):
    """Where the kernel has AMX tiles (else it refuses): ragged panel groups (100: 7 panels) and
    tails of rows under a tile's 32, against F.linear; a row's bits at any count, offset or thread
    count, with the bias in either form."""
    weight, b = bf16_layer(out_features, in_features, bias)
    packed = matmul.pack_pairs(weight)
    x = torch.randn(203, in_features).bfloat16()
    if not matmul.native_amx():
        with pytest.raises(RuntimeError, match="refused"):
            matmul.linear_amx(x, packed, out_features, in_features, b)
        return
    full = matmul.linear_amx(x, packed, out_features, in_features, b)
    torch.testing.assert_close(full.float(), F.linear(x.float(), weight.float(), None if b is None else b.float()),
                               rtol=1e-2, atol=0.1)
    for rows in (0, 1, 2, 15, 16, 17, 31, 32, 33, 64, 96, 202):  # 0: a step that samples no row
        for start in (0, 203 - rows, rows // 3):
            assert torch.equal(matmul.linear_amx(x[start:start + rows], packed, out_features, in_features, b),
                               full[start:start + rows]), (rows, start)
    if b is not None:
        assert torch.equal(matmul.linear_amx(x, packed, out_features, in_features,
                                             matmul.panel_bias(b, out_features)), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(matmul.linear_amx(x, packed, out_features, in_features, b), full)
    finally:
        torch.set_num_threads(threads)


def test_amx_work_taken_from_other_threads_shares_gives_the_same_bits_and_choices():
    """The AMX kernels deal their work in shares a thread done with its own takes units from the back
    of (common.h's Deal): with more threads than cores a thread often runs late and loses units, so
    each call's units run in an order and on threads that vary. Outputs, SiLU-and-mul outputs and
    greedy choices (ties across groups: small integer weights, whose later group may now be folded
    first) are those of one thread, call after call."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randint(-2, 3, (1152, 64), generator=g).bfloat16()  # 36 groups; gate and up halves of 576
    packed = matmul.pack_pairs(weight)
    x = torch.randint(-2, 3, (70, 64), generator=g).bfloat16()
    if not matmul.native_amx():
        with pytest.raises(RuntimeError, match="refused"):
            matmul.linear_amx_argmax(x, packed, 1152, 64, None)
        return
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {rows: (matmul.linear_amx(x[:rows], packed, 1152, 64, None),
                      matmul.linear_amx_silu(x[:rows], packed, 1152, 64),
                      matmul.linear_amx_argmax(x[:rows], packed, 1152, 64, None)) for rows in (1, 33, 70)}
        assert any(int((row == row.max()).sum()) > 1 for row in one[70][0].float())  # ties are there to break
        for n in (3, 5, 8):
            torch.set_num_threads(n)
            for _ in range(4):
                for rows, (out, silu, chosen) in one.items():
                    assert torch.equal(matmul.linear_amx(x[:rows], packed, 1152, 64, None), out), (n, rows)
                    assert torch.equal(matmul.linear_amx_silu(x[:rows], packed, 1152, 64), silu), (n, rows)
                    assert torch.equal(matmul.linear_amx_argmax(x[:rows], packed, 1152, 64, None), chosen), (n, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("kernel", "inter", "in_features"), [
    (kernel, inter, in_features) for kernel in ("amx", "bf16-dpbf16", "bf16-fma")
    for inter, in_features in ((1536, 576), (48, 64), (32, 33)) if kernel != "amx" or in_features % 32 == 0])
def test_gate_up_with_silu_gives_silu_and_mul_of_its_outputs_bit_for_bit(kernel, inter, in_features):
    """linear_amx_silu and linear_bf16_silu (an MLP's gate and up projections with SiLU-and-mul in their
    epilogue, where the kernel has AMX tiles or AVX512-BF16, else refused; the latter with VDPBF16PS
    and with its FMA form): the bits of elementwise.silu_and_mul on linear_amx's or linear_bf16's
    outputs, at row counts about a tile's (32 rows on AMX, 12 on the vectors) and a chunk's (96), on
    1 and 2 threads, with rows of zeros, an infinite and a NaN input and large values (SiLU's exp past
    its range); shapes whose halves are not whole panels refused."""
    from batchapi.kernels.cpu import elementwise

    amx = kernel == "amx"  # K in whole tiles of 32
    linear, fused = (matmul.linear_amx, matmul.linear_amx_silu) if amx else (matmul.linear_bf16,
                                                                            matmul.linear_bf16_silu)
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(2 * inter, in_features, generator=g) / in_features**0.5).bfloat16()
    packed = matmul.pack_pairs(weight)
    x = (3 * torch.randn(203, in_features, generator=g)).bfloat16()
    x[1], x[2, 0], x[3, 1], x[4, 2] = 0.0, float("inf"), float("nan"), 3e4
    if not (matmul.native_amx() if amx else matmul.native_bf16()):
        with pytest.raises(RuntimeError, match="refused"):
            fused(x, packed, 2 * inter, in_features)
        return
    threads = torch.get_num_threads()
    instructions = None if amx else matmul.bf16_instructions()
    try:
        if not amx:
            matmul.bf16_instructions(kernel.removeprefix("bf16-"))
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (0, 1, 5, 11, 12, 13, 31, 32, 33, 96, 97, 203):
                expected = elementwise.silu_and_mul(linear(x[:rows], packed, 2 * inter, in_features, None))
                got = fused(x[:rows], packed, 2 * inter, in_features)
                assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (rows, n)
    finally:
        torch.set_num_threads(threads)
        if instructions:
            matmul.bf16_instructions(instructions)
    with pytest.raises(ValueError, match="multiple"):
        fused(x, matmul.pack_pairs(weight[:2 * inter - 16]), 2 * inter - 16, in_features)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("linear", "argmax", "native"), [
    (matmul.linear_bf16, matmul.linear_bf16_argmax, lambda: True),  # AVX512-BF16, else the same sums in plain C
    (matmul.linear_amx, matmul.linear_amx_argmax, matmul.native_amx)])  # where there are AMX tiles, else refused
def test_argmax_is_the_argmax_of_the_linears_outputs(linear, argmax, native, bias, instructions):
    """The index torch's argmax gives on the kernel's bf16 outputs, with ties across panels and thread
    shares (small integer weights), a NaN row, a row of zeros, ragged panel groups (100 outputs) and a
    lm_head's width, at row counts about a tile's (8 rows, AMX's 32) and none, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(3)
    cases = [(torch.randint(-2, 3, (100, 64), generator=g).bfloat16(), torch.randint(-2, 3, (90, 64), generator=g)),
             (torch.randn(4099, 96, generator=g).bfloat16(), torch.randn(90, 96, generator=g))]
    for weight, x in cases:
        out_features, in_features = weight.shape
        b = torch.randint(-2, 3, (out_features,), generator=g).bfloat16() if bias else None
        packed, x = matmul.pack_pairs(weight), x.bfloat16()
        x[3], x[5] = float("nan"), 0.0
        if not native():
            with pytest.raises(RuntimeError, match="refused"):
                argmax(x, packed, out_features, in_features, b)
            return
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                for rows in (0, 1, 7, 9, 31, 32, 33, 90):
                    expected = linear(x[:rows], packed, out_features, in_features, b).argmax(-1)
                    assert torch.equal(argmax(x[:rows], packed, out_features, in_features, b), expected), (
                        out_features, rows, n)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("bias", [False, True])
def test_the_stored_argmax_is_the_argmax_of_the_float32_outputs(bias):
    """linear_argmax: the index torch's argmax gives on ``linear``'s float32 outputs, with ties across
    panels and thread shares (small integer weights), a NaN row, rows with one NaN or infinite output, a
    row of zeros, a row of infinite and NaN outputs, ragged panels (100 outputs) and a lm_head's width, at row counts
    about a tile's (6 rows) and none, on 1 and 2 threads; refused where linear refuses."""
    g = torch.Generator().manual_seed(4)
    cases = [(torch.randint(-2, 3, (100, 64), generator=g).float(), torch.randint(-2, 3, (40, 64), generator=g)),
             (torch.randn(4099, 96, generator=g).bfloat16().float(), torch.randn(40, 96, generator=g))]
    for weight, x in cases:
        out_features, in_features = weight.shape
        b = torch.randint(-2, 3, (out_features,), generator=g).float() if bias else None
        x = x.float()
        x[3], x[5] = float("nan"), 0.0
        # column 18 (a whole panel's third) inf - inf = NaN where x[:, 7] and x[:, 8] share a sign, else +-inf
        weight[18, 7], weight[18, 8] = float("inf"), float("-inf")
        x[8, 7], x[8, 8], x[9, 7], x[9, 8] = 1.0, 1.0, 1.0, -1.0
        x[10] = 0.0
        x[10, 0] = float("inf")  # outputs of +-inf and NaN (inf * 0)
        packed = matmul.pack(weight)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                for rows in (0, 1, 5, 7, 13, 40):
                    expected = matmul.linear(x[:rows], packed, out_features, b).argmax(-1)
                    chosen = matmul.linear_argmax(x[:rows], packed, out_features, b)
                    assert torch.equal(chosen, expected), (out_features, rows, n)
        finally:
            torch.set_num_threads(threads)
    with pytest.raises(ValueError):
        matmul.linear_argmax(torch.randn(3, 19), matmul.pack(torch.randn(37, 19).bfloat16().float()), 49, None)


def test_amx_linear_refuses_k_in_part_chunks():
    weight, _ = bf16_layer(32, 48, False)  # 48: one and a half chunks of 32
    with pytest.raises(ValueError, match="multiple of 32"):
        matmul.linear_amx(torch.randn(3, 48).bfloat16(), matmul.pack_pairs(weight), 32, 48, None)


def peaked_head(out_features: int, in_features: int, rows: int, seed: int):
    """A lm_head and rows of x whose outputs peak as a chat model's do: each row near one column, some
    near two (a near tie, closer than the screen's bounds), and a few channels of x far larger than the
    rest (a model's outlier channels)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    twins = torch.randint(0, out_features, (8,), generator=g)
    weight[twins[4:]] = weight[twins[:4]] + 1e-3 * torch.randn(4, in_features, generator=g)
    weight[100] = weight[50]  # an exact tie: the first column in the second group, the other in the third
    top = torch.randint(0, out_features, (rows,), generator=g)
    top[:4], top[4:8] = twins[:4], 50
    x = 4 * weight[top] * in_features**0.5 + torch.randn(rows, in_features, generator=g)
    x[:, torch.randperm(in_features, generator=g)[:6]] *= 20
    # lopsided columns: the largest output of rows 8..19, whose one large weight (where x is 0) leaves the
    # rest rounded to int8 coarsely, against a column 2% behind that int8 rounds well: the bound decides
    x[8:20, 0] = 0.0
    for r in range(8, 20):
        weight[7 + 48 * r] = x[r] / x[r].norm()
        weight[8 + 48 * r] = 0.98 * x[r] / x[r].norm()
        weight[7 + 48 * r, 0] = 30.0
    return weight.bfloat16(), x.bfloat16()


@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_screen_chooses_what_the_argmax_chooses(bias, instructions):
    """linear_bf16_argmax_screened: the index linear_bf16_argmax gives, on peaked rows (near and exact
    ties across groups and thread shares, outlier channels), flat ones (random x), a row of zeros, NaN
    and infinite rows (the exact kernel's), ragged groups, with a bias, on 1 and 2 threads; and on the
    peaked rows it computes few of the rows' groups exactly (where this build screens)."""
    for out_features, seed in ((4099, 0), (1000, 1)):
        weight, x = peaked_head(out_features, 96, 90, seed)
        g = torch.Generator().manual_seed(seed)
        flat = torch.randn(20, 96, generator=g).bfloat16()
        flat[3], flat[5], flat[7, 10] = 0.0, float("nan"), float("inf")
        b = torch.randint(-2, 3, (out_features,), generator=g).float() if bias else None
        packed, screen = matmul.pack_pairs(weight), matmul.pack_screen(weight)
        groups = -(-out_features // 48)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                for rows in (0, 1, 9, 33, 90):
                    expected = matmul.linear_bf16_argmax(x[:rows], packed, out_features, 96, b)
                    chosen, exact = matmul.linear_bf16_argmax_screened(x[:rows], packed, screen, out_features, 96, b)
                    assert torch.equal(chosen, expected), (out_features, rows, n)
                    if rows and matmul.screen_native() and instructions == "dpbf16":
                        assert exact < rows * groups / 4, (exact, rows * groups)
                for rows in (slice(0, 20), slice(3, 4), slice(6, 20)):  # the last with a NaN and an inf
                    expected = matmul.linear_bf16_argmax(flat[rows], packed, out_features, 96, b)
                    chosen, _ = matmul.linear_bf16_argmax_screened(flat[rows], packed, screen, out_features, 96, b)
                    assert torch.equal(chosen, expected), (out_features, rows, n)
        finally:
            torch.set_num_threads(threads)


def test_the_screen_is_not_made_for_a_weight_it_cannot_bound():
    assert matmul.pack_screen(torch.randn(10, 30).bfloat16()) is None  # K not a multiple of 4
    assert matmul.pack_screen(torch.randn(10, 16).bfloat16()) is None  # K under 32: no pairs to take
    weight = torch.randn(10, 64).bfloat16()
    weight[2, 5] = float("inf")
    assert matmul.pack_screen(weight) is None
    weight[2, 5], weight[3] = 1.0, 1e38  # a column whose norm is past float32
    assert matmul.pack_screen(weight) is None


def screened_and_exact(weight, x, bias=None):
    out_features, in_features = weight.shape
    packed, screen = matmul.pack_pairs(weight.bfloat16()), matmul.pack_screen(weight.bfloat16())
    chosen, _ = matmul.linear_bf16_argmax_screened(x.bfloat16(), packed, screen, out_features, in_features, bias)
    return chosen, matmul.linear_bf16_argmax(x.bfloat16(), packed, out_features, in_features, bias)


def test_the_screen_reads_denormals_and_bounds_as_the_kernel_does():
    """Denormal weights and inputs, which VDPBF16PS reads as zero; the caller's MXCSR flushing
    denormals (torch.set_flush_denormal); a NaN bias (the exact kernel's first NaN)."""
    k, n = 256, 96
    weight = torch.zeros(n, k)
    weight[0], weight[48, 100] = 1e-39, 2.0**-125  # denormal in bf16; the other the smallest normal's double
    assert torch.equal(*screened_and_exact(weight, torch.full((1, k), 1e20)))
    weight = torch.zeros(n, k)
    weight[0] = 1e28
    x = torch.full((1, k), 1e-39)
    assert torch.equal(*screened_and_exact(weight, x, torch.eye(n)[48] * 1e-9))
    weight = torch.zeros(n, k)
    weight[0], weight[48, 100] = 1e-37, 1e-35
    try:
        torch.set_flush_denormal(True)  # no getter: back to off, the default, after
        assert torch.equal(*screened_and_exact(weight, torch.full((1, k), 1e20)))
    finally:
        torch.set_flush_denormal(False)
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(n, k, generator=g), torch.randn(1, k, generator=g)
    weight[60] = 10 * x[0]
    for column in (0, 40):
        bias = torch.zeros(n)
        bias[column] = float("nan")
        chosen, expected = screened_and_exact(weight, x, bias)
        assert torch.equal(chosen, expected) and expected.item() == column


def test_the_screen_deals_its_groups_to_the_threads_openmp_starts(tmp_path):
    """OMP_THREAD_LIMIT=1 with 2 threads asked for: one thread takes every group."""
    script = tmp_path / "limit.py"
    script.write_text(
        "import torch\n"
        "from batchapi.kernels.cpu import matmul\n"
        "torch.set_num_threads(2)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w, x = torch.randn(4800, 256, generator=g), torch.randn(8, 256, generator=g)\n"
        "for r in range(8):\n"
        "    w[48 * (2 * r + 1) + 5] = 10 * x[r]  # each row's largest in a group dealt to a second thread\n"
        "w, x = w.bfloat16(), x.bfloat16()\n"
        "packed, screen = matmul.pack_pairs(w), matmul.pack_screen(w)\n"
        "chosen, _ = matmul.linear_bf16_argmax_screened(x, packed, screen, 4800, 256, None)\n"
        "assert torch.equal(chosen, matmul.linear_bf16_argmax(x, packed, 4800, 256, None)), chosen\n")
    env = {**os.environ, "OMP_THREAD_LIMIT": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

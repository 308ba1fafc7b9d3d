"""Batch invariance of every CPU op the engine runs: each token's or row's bits do not depend on the
row count, its position among the rows, or the split of its sequence into steps. The attention of
the C kernel and of the twin's invariant path; the elementwise ops of both sets; the linear
layers at the real default model's shapes through engine.model.linears. (The Triton ones: triton/.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchapi.engine.model.linears import (
    BLOCK_ROWS,
    InvariantLinear,
    PackedLinear,
    RowCounts,
    can_pack,
    invariant_linear,
    invariant_row_counts,
    probe_input,
    probe_rows,
)
from batchapi.engine.platform import fastest_cpu_dtype
from batchapi.kernels import CPU_OPS, TORCH_OPS, get_ops
from batchapi.kernels.torch.attention import invariant_paged_attention
from batchapi.kernels.torch.rope import build_rope_cache
from tests.kernels.invariance import check_attention, check_rows

DTYPES = [torch.float32, torch.bfloat16]
# the linear layers' probe at the default model's shapes: float32, and bf16 where the CPU has it natively
# (emulated bf16 is never picked there, and at the lm_head's shape takes minutes on such a CPU)
LINEAR_DTYPES = sorted({torch.float32, fastest_cpu_dtype()}, key=str)
# (window, softcap): the whole context; a sliding window that starts mid-block (a block of 8, 16 or
# 32 tokens), with Gemma 2's soft cap
WINDOWS = [(0, 0.0), (20, 30.0)]


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(6, 2, 64, 16), (9, 3, 64, 16), (4, 4, 32, 8), (4, 1, 128, 32)])
def test_the_c_attention_is_invariant(dtype, hq, hkv, d, block_size, window, softcap):
    attention = get_ops("cpu", "cpu", invariant=True).paged_attention
    check_attention(attention, dtype, hq, hkv, d, block_size, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,block_size,window,softcap", [(6, 2, 64, 16, 0, 0.0), (4, 4, 32, 8, 0, 0.0),
                                                                (4, 4, 32, 8, *WINDOWS[1])])
def test_the_twins_invariant_attention_is_invariant(dtype, hq, hkv, d, block_size, window, softcap):
    check_attention(invariant_paged_attention, dtype, hq, hkv, d, block_size, window=window, softcap=softcap)


def test_the_c_kernel_in_fp16_falls_back_to_the_invariant_twin():
    assert get_ops("cpu", "cpu", invariant=True).paged_attention is not CPU_OPS.paged_attention
    check_attention(get_ops("cpu", "cpu", invariant=True).paged_attention, torch.float16)


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_invariant_attentions_agree_with_the_plain_one(dtype, window, softcap):
    from tests.kernels.paged import make_case

    case = make_case([1, 40, 7, 1], [30, 40, 90, 17], 6, 2, 64, dtype=dtype, seed=3, window=window, freed="nan")
    if softcap:
        case.q.mul_(10.0)
    kwargs = dict(window=window, softcap=softcap)
    expected = TORCH_OPS.paged_attention(*case.args(), case.scale, **kwargs).float()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for attention in (invariant_paged_attention, get_ops("cpu", "cpu", invariant=True).paged_attention):
        torch.testing.assert_close(attention(*case.args(), case.scale, **kwargs).float(), expected, atol=tol,
                                   rtol=tol)


@pytest.mark.parametrize("ops", [CPU_OPS, TORCH_OPS], ids=["cpu", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_elementwise_ops_are_invariant(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 576, generator=g).to(dtype)
    residual = torch.randn(300, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype)
    check_rows(lambda t: ops.rms_norm(t, weight, 1e-5), x)
    check_rows(lambda t, r: ops.fused_add_rms_norm(t, r, weight, 1e-5), x, residual)
    check_rows(ops.silu_and_mul, torch.randn(300, 2 * 1536, generator=g).to(dtype))
    check_rows(ops.argmax, torch.randn(300, 49152, generator=g).to(dtype))
    cos_sin = build_rope_cache(64, 1024, 10000.0, None, "cpu", dtype)
    positions = torch.randint(0, 1024, (300,), generator=g)
    q, k = torch.randn(300, 9, 64, generator=g).to(dtype), torch.randn(300, 3, 64, generator=g).to(dtype)
    check_rows(lambda q, k, p: ops.rotary(q, k, p, cos_sin), q, k, positions)
    bitmask = torch.randint(-2**31, 2**31, (300, 49152 // 32), generator=g, dtype=torch.int64).to(torch.int32)

    def masked(logits, words):
        logits = logits.clone()
        ops.apply_token_bitmask(logits, words, list(range(logits.shape[0])))
        return logits

    check_rows(masked, torch.randn(300, 49152, generator=g).to(dtype), bitmask)

    def stored(keys, values, slots):  # each token's slot gets its row, whatever else is stored with it
        k_cache = torch.zeros(40, 16, 3, 64, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        ops.store_kvcache(keys, values, k_cache, v_cache, slots)
        flat = slots.long()
        return k_cache.view(-1, 3, 64)[flat], v_cache.view(-1, 3, 64)[flat]

    check_rows(stored, k, k.flip(0).contiguous(), torch.randperm(640, generator=g)[:300])


SMOLLM2_LINEARS = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out)
TEST_MODEL_DOWN_PROJ = (512, 192)  # tests/engine/test_invariance.py's; the old probe missed its kernel changes


def _linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
    """A layer as the engine loads it: packed for oneDNN where it can be."""
    linear = nn.Linear(in_features, out_features, bias=False).to(dtype).requires_grad_(False)
    linear.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(5))
    return PackedLinear.from_linear(linear, batch_hint=256) if can_pack(linear) else linear


@torch.inference_mode()
def _check_linear(layer: nn.Module, max_rows: int, seed: int) -> None:
    """Every row count 1..80 (a wide layer 1..40), and more up to ``max_rows``, in several
    positions, on rows whose bf16 outputs show a change in the order of the fp32 sums."""
    x = probe_input(layer.weight, max_rows, seed)
    full = layer(x)
    wide = layer.weight.shape[0] > 10_000  # the lm_head: fewer counts, as each costs 50x a projection's
    dense = 41 if wide else 81
    counts = list(range(1, dense)) + list(range(dense, max_rows + 1, 23 if wide else 7))
    for m in counts:
        for start in {0, max_rows - m} if wide else {0, (37 * m) % (max_rows - m + 1), max_rows - m}:
            assert torch.equal(layer(x[start : start + m]), full[start : start + m]), (m, start)


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
@pytest.mark.parametrize("in_features,out_features", SMOLLM2_LINEARS + [TEST_MODEL_DOWN_PROJ])
def test_the_linear_layers_at_the_default_models_shapes_are_invariant(dtype, in_features, out_features):
    """The layer the engine runs (as it is, padded, or in blocks, as the probe decides on this CPU)
    holds beyond the counts and the rows the probe itself compares."""
    max_rows = 300
    _check_linear(invariant_linear(_linear(in_features, out_features, dtype), max_rows), max_rows, seed=5)


@pytest.mark.parametrize("in_features,out_features", SMOLLM2_LINEARS[:4])
def test_the_projections_at_the_engines_step_size_are_invariant(in_features, out_features):
    """At the engine's 4096 rows a step, where oneDNN's AMX kernel in bf16 gives the largest call's
    sums at 1..32 rows and from about N rows on, so the probe splits the counts between: every
    count 1..300 in three positions, and the counts around the one from which it runs one call. In
    the dtype ``auto`` picks: bf16 where the CPU has it natively, else float32 (emulated bf16 at
    4096 rows would take minutes, and is never picked there)."""
    max_rows = 4096
    layer = invariant_linear(_linear(in_features, out_features, fastest_cpu_dtype()), max_rows)
    if isinstance(layer, InvariantLinear) and layer.split_rows is not None:
        large = [layer.min_rows - 1, layer.min_rows, layer.min_rows + 1, 3001, max_rows - 1]
    else:  # another CPU: whatever the probe chose holds
        large = [511, 2048, max_rows - 1]
    x = probe_input(layer.weight, max_rows, seed=7)
    with torch.inference_mode():
        full = layer(x)
        for m in [*range(1, 301), *large]:
            for start in {0, (37 * m) % (max_rows - m + 1), max_rows - m}:
                assert torch.equal(layer(x[start : start + m]), full[start : start + m]), (m, start)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features,out_features", [(576, 576), (1536, 576)])
def test_the_blocks_fallback_is_invariant_on_this_cpus_kernels(dtype, in_features, out_features):
    """A row's bits depend neither on its place in a block nor on the number of blocks."""
    layer = InvariantLinear(_linear(in_features, out_features, dtype), BLOCK_ROWS, block_rows=BLOCK_ROWS)
    _check_linear(layer, 300, seed=6)


def test_the_probe_covers_small_counts_densely():
    rows = probe_rows(12, 4096)
    assert rows[:14] == list(range(12, 26)) and 4095 in rows and 4096 not in rows  # 4096: the reference call
    assert {31, 32, 33, 63, 64, 65, 255, 256, 257, 511, 512, 513} <= set(rows)
    assert {176, 1280} <= set(rows)  # inside 168..191 and 1159..1904, where AMX kernels changed


def test_a_layer_that_is_not_invariant_is_found_and_runs_in_fixed_blocks():
    class RowCountDependent(nn.Linear):  # adds a tiny term that depends on the number of rows
        def forward(self, x):
            return super().forward(x) + x.shape[0] * 1e-3

    linear = RowCountDependent(16, 8, bias=False).requires_grad_(False)
    assert invariant_row_counts(linear, 100) == RowCounts(None, 0)
    layer = InvariantLinear(linear, 64, block_rows=64)
    x = torch.randn(100, 16)
    with torch.inference_mode():
        full = layer(x)
        assert all(torch.equal(layer(x[:m]), full[:m]) for m in (1, 5, 64, 65, 99))


def test_padding_makes_a_small_count_kernel_invariant():
    class SmallCountsDiffer(nn.Linear):  # another answer below 4 rows, as MKL's fp32 kernels give
        def forward(self, x):
            out = super().forward(x)
            return out + 1e-3 if x.shape[0] < 4 else out

    linear = SmallCountsDiffer(16, 8, bias=False).requires_grad_(False)
    assert invariant_row_counts(linear, 64) == RowCounts(4, 0)
    layer = InvariantLinear(linear, 4)
    x = torch.randn(64, 16)
    with torch.inference_mode():
        full = layer(x)
        assert all(torch.equal(layer(x[:m]), full[:m]) for m in (1, 2, 3, 4, 50))

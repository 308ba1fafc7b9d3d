"""The C elementwise kernels and argmax (kernels.cpu.elementwise, csrc/elementwise.c) against their torch twins.

fp32 matches the twin to rounding (silu's exp differs, and off x86 the variance sum's order may);
bf16 matches it element for element but for rare one-ulp differences where such an fp32 difference
lands on a bf16 rounding tie.
"""

import platform
from types import SimpleNamespace

import pytest
import torch

from batchapi.kernels import TORCH_OPS, build_rope_cache
from batchapi.kernels.cpu import build, elementwise
from tests.kernels.march import PORTABLE, load_portable_elementwise

TWIN = TORCH_OPS
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 8), (3, 72), (96, 576), (5, 100), (2, 1)]  # (rows, size): odd sizes take the masked tail
ELEMENTWISE = ["rms_norm", "fused_add_rms_norm", "rotary", "rotary_store", "silu_and_mul", "store_kvcache"]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert build.load_elementwise() is not None, "the test machine has a C compiler: the kernels must build"


@pytest.fixture
def c_only(monkeypatch):
    """A fall-back to a twin fails the test (the oracles, TWIN's, stay the real ones)."""
    def fail(name):
        return lambda *a, **k: pytest.fail(f"{name} went to the twin")

    monkeypatch.setattr(elementwise, "twin", SimpleNamespace(**{name: fail(name) for name in ELEMENTWISE}))


def randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def assert_matches(out: torch.Tensor, twin: torch.Tensor) -> None:
    assert out.dtype == twin.dtype and out.shape == twin.shape
    assert torch.equal(out.isnan(), twin.isnan()), "NaN where the twin has none, or the reverse"
    out, twin = out[~twin.isnan()], twin[~twin.isnan()]
    if twin.dtype == torch.float32:
        torch.testing.assert_close(out, twin, rtol=1e-6, atol=1e-30)
        return
    differ = out != twin
    assert differ.float().mean() < 0.005, f"{int(differ.sum())} of {differ.numel()} elements differ"
    ulps = (out[differ].view(torch.int16).int() - twin[differ].view(torch.int16).int()).abs()
    assert ulps.numel() == 0 or int(ulps.max()) <= 1, f"a difference of {int(ulps.max())} bf16 ulps"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), SHAPES)
def test_norms_match_the_twin(rows, hidden, dtype, c_only):
    x, residual = randn(rows, hidden, dtype=dtype, seed=1), randn(rows, hidden, dtype=dtype, scale=3, seed=2)
    weight = randn(hidden, dtype=dtype, seed=3)
    assert_matches(elementwise.rms_norm(x, weight, 1e-6), TWIN.rms_norm(x, weight, 1e-6))
    normed, summed = elementwise.fused_add_rms_norm(x, residual, weight, 1e-5)
    twin_normed, twin_summed = TWIN.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, twin_summed), "one add, rounded once: no room for a difference"
    assert_matches(normed, twin_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [5, 8, 100, 576, 2048, 4096 + 72])  # 2048 and up: the sum's cascade
def test_norms_add_the_squares_in_torchs_order(hidden, dtype, c_only):
    # on x86 the same variance bit for bit (torch's 8-lane sum kernel), so outputs equal to the
    # twin's; elsewhere torch sums in another order, and they are only close
    def same(out, twin):
        if platform.machine() in ("x86_64", "AMD64"):
            assert torch.equal(out, twin)
        else:
            assert_matches(out, twin)

    x = randn(8, hidden, dtype=dtype, scale=5, seed=hidden)
    residual, weight = randn(8, hidden, dtype=dtype, seed=1), randn(hidden, dtype=dtype, seed=2)
    same(elementwise.rms_norm(x, weight, 1e-6), TWIN.rms_norm(x, weight, 1e-6))
    same(elementwise.fused_add_rms_norm(x, residual, weight, 1e-6)[0], TWIN.fused_add_rms_norm(x, residual, weight, 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), SHAPES + [(96, 1536)])
def test_silu_and_mul_matches_the_twin(rows, inter, dtype, c_only):
    x = randn(rows, 2 * inter, dtype=dtype, scale=4, seed=inter)  # gates far into both tails of the exp
    assert_matches(elementwise.silu_and_mul(x), TWIN.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_the_edges_of_the_exp(dtype, c_only):
    gates = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0, 104.0, -104.0, 200.0,
                          -200.0, 3e38, -3e38, float("inf"), float("-inf"), float("nan"), 0.5, -0.5, 1.0])
    up = torch.linspace(-3, 3, gates.numel())
    x = torch.cat([gates, up])[None].to(dtype)  # [1, 2I]
    assert_matches(elementwise.silu_and_mul(x), TWIN.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_keep_nan_and_inf(dtype, c_only):
    x = randn(4, 40, dtype=dtype, seed=5)
    x[1, 3], x[2, 7], x[3, 0] = float("nan"), float("inf"), 1e30
    residual, weight = randn(4, 40, dtype=dtype, seed=6), randn(40, dtype=dtype, seed=7)
    assert_matches(elementwise.rms_norm(x, weight, 1e-6), TWIN.rms_norm(x, weight, 1e-6))
    for out, twin in zip(elementwise.fused_add_rms_norm(x, residual, weight, 1e-6),
                         TWIN.fused_add_rms_norm(x, residual, weight, 1e-6), strict=True):
        assert_matches(out, twin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_denormal_results_round_as_the_twin_rounds(dtype, c_only):
    x = randn(3, 48, dtype=dtype, seed=17)
    weight = torch.full((48,), 3e-39).to(dtype)  # weight * y lands below fp32's smallest normal
    out = elementwise.rms_norm(x, weight, 1e-6)
    assert (out != 0).any() and (out.abs() < 1.1754944e-38).all()
    assert torch.equal(out, TWIN.rms_norm(x, weight, 1e-6))


def qkv_views(rows, hq, hkv, d, dtype, seed=0):
    """q, k, v as the engine makes them: column slices of one qkv matrix (rows dense, strided)."""
    qkv = randn(rows, (hq + 2 * hkv) * d, dtype=dtype, scale=2, seed=seed)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(rows, hq, d), k.view(rows, hkv, d), v.view(rows, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hq", "hkv", "d"), [(96, 9, 3, 64), (1, 4, 4, 8), (3, 2, 1, 72), (5, 3, 1, 100),
                                                      (2, 1, 1, 2)])
def test_rotary_matches_the_twin(rows, hq, hkv, d, dtype, cache_dtype, c_only):
    q, k, _ = qkv_views(rows, hq, hkv, d, dtype, seed=d)
    cos_sin = build_rope_cache(d, 4096, 10000.0, None, "cpu", cache_dtype)
    positions = torch.randperm(4096, generator=torch.Generator().manual_seed(rows))[:rows]  # out of order
    for out, twin in zip(elementwise.rotary(q, k, positions, cos_sin), TWIN.rotary(q, k, positions, cos_sin),
                         strict=True):
        assert_matches(out, twin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kvcache_matches_the_twin(dtype, slot_dtype, c_only):
    _, k, v = qkv_views(7, 6, 2, 64, dtype)
    slots = torch.tensor([5, -1, 63, 0, 17, -1, 40], dtype=slot_dtype)  # -1: skipped
    caches = [torch.zeros(4, 16, 2, 64, dtype=dtype) for _ in range(4)]
    elementwise.store_kvcache(k, v, caches[0], caches[1], slots)
    TWIN.store_kvcache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hq", "hkv", "d"), [(96, 9, 3, 64), (7, 4, 4, 8), (3, 2, 1, 72), (5, 3, 1, 100)])
def test_rotary_store_is_rotary_then_the_store(rows, hq, hkv, d, dtype, cache_dtype, c_only):
    q, k, v = qkv_views(rows, hq, hkv, d, dtype, seed=d + 1)
    cos_sin = build_rope_cache(d, 4096, 10000.0, None, "cpu", cache_dtype)
    positions = torch.randperm(4096, generator=torch.Generator().manual_seed(rows))[:rows]
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(d))[:rows]
    slots[::3] = -1  # skipped: nothing stored
    caches = [torch.zeros(8, 16, hkv, d, dtype=dtype) for _ in range(4)]
    q_out = elementwise.rotary_store(q, k, v, positions, cos_sin, caches[0], caches[1], slots)
    q_twin, k_twin = TWIN.rotary(q, k, positions, cos_sin)
    TWIN.store_kvcache(k_twin, v, caches[2], caches[3], slots)
    assert_matches(q_out, q_twin)
    assert_matches(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    # and exactly what the C rotary and the C store give
    q_c, k_c = elementwise.rotary(q, k, positions, cos_sin)
    caches_c = [torch.zeros(8, 16, hkv, d, dtype=dtype) for _ in range(2)]
    elementwise.store_kvcache(k_c, v, caches_c[0], caches_c[1], slots)
    assert torch.equal(q_out, q_c) and torch.equal(caches[0], caches_c[0]) and torch.equal(caches[1], caches_c[1])


def test_rotary_store_refuses_bad_positions_and_slots_before_writing(c_only):
    q, k, v = qkv_views(3, 4, 2, 64, torch.float32)
    cos_sin = build_rope_cache(64, 16, 10000.0, None, "cpu", torch.float32)
    k_cache, v_cache = torch.zeros(2, 4, 2, 64), torch.zeros(2, 4, 2, 64)
    with pytest.raises(ValueError, match="positions"):
        elementwise.rotary_store(q, k, v, torch.tensor([0, 16, 1]), cos_sin, k_cache, v_cache, torch.arange(3))
    with pytest.raises(ValueError, match="slots"):
        elementwise.rotary_store(q, k, v, torch.arange(3), cos_sin, k_cache, v_cache, torch.tensor([0, 8, -1]))
    assert not k_cache.any() and not v_cache.any()


def test_non_contiguous_inputs_are_copied_not_misread(c_only):
    x = randn(72, 5, dtype=torch.bfloat16, seed=8).t()  # [5, 72], columns dense: no row is
    weight = randn(144, dtype=torch.bfloat16, seed=9)[::2]
    assert_matches(elementwise.rms_norm(x, weight, 1e-6), TWIN.rms_norm(x, weight, 1e-6))
    gate_up = randn(64, 6, dtype=torch.float32, seed=10).t()
    assert_matches(elementwise.silu_and_mul(gate_up), TWIN.silu_and_mul(gate_up))
    q = randn(3, 64, 4, dtype=torch.float32, seed=11).transpose(1, 2)  # [3, 4, 64], heads interleaved
    k = randn(3, 2, 64, dtype=torch.float32, seed=12)
    cos_sin = build_rope_cache(64, 16, 10000.0, None, "cpu", torch.float32)
    positions = torch.tensor([3, 0, 15])
    for out, twin in zip(elementwise.rotary(q, k, positions, cos_sin), TWIN.rotary(q, k, positions, cos_sin),
                         strict=True):
        assert_matches(out, twin)


def test_threads_split_rows_without_changing_them():
    x, residual = randn(96, 576, dtype=torch.bfloat16, seed=13), randn(96, 576, dtype=torch.bfloat16, seed=14)
    weight, gate_up = randn(576, dtype=torch.bfloat16, seed=15), randn(96, 3072, dtype=torch.bfloat16, seed=16)
    q, k, _ = qkv_views(96, 9, 3, 64, torch.bfloat16)
    cos_sin, positions = build_rope_cache(64, 512, 10000.0, None, "cpu", torch.bfloat16), torch.arange(96) * 5

    def run():
        return [*elementwise.fused_add_rms_norm(x, residual, weight, 1e-5), elementwise.silu_and_mul(gate_up),
                *elementwise.rotary(q, k, positions, cos_sin)]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


class _Untouchable:
    def __getattr__(self, name):
        pytest.fail(f"{name} was called in C")


def test_what_c_does_not_take_goes_to_the_twin(monkeypatch):
    monkeypatch.setattr(elementwise, "load_elementwise", _Untouchable)

    def same(out, twin):
        return all(torch.equal(a, b) for a, b in zip(out, twin, strict=True))

    x16, w16 = randn(3, 64, dtype=torch.float16), randn(64, dtype=torch.float16)
    assert torch.equal(elementwise.rms_norm(x16, w16, 1e-6), TWIN.rms_norm(x16, w16, 1e-6))  # no fp16 in C
    x, w32 = randn(3, 64, dtype=torch.bfloat16), randn(64, dtype=torch.float32)  # the twin promotes to fp32
    assert torch.equal(elementwise.rms_norm(x, w32, 1e-6), TWIN.rms_norm(x, w32, 1e-6))
    assert same(elementwise.fused_add_rms_norm(x, x.float(), w32, 1e-6), TWIN.fused_add_rms_norm(x, x.float(), w32, 1e-6))
    x3 = randn(2, 3, 64, dtype=torch.bfloat16)  # not [N, H]
    assert torch.equal(elementwise.silu_and_mul(x3), TWIN.silu_and_mul(x3))
    for d, dtype in [(64, torch.float16), (520, torch.float32)]:  # fp16; heads over 512
        q, k, _ = qkv_views(3, 2, 1, d, dtype)
        cos_sin = build_rope_cache(d, 8, 10000.0, None, "cpu", dtype)
        assert same(elementwise.rotary(q, k, torch.arange(3), cos_sin), TWIN.rotary(q, k, torch.arange(3), cos_sin))
    _, k, v = qkv_views(3, 2, 1, 64, torch.float16)
    caches = [torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16) for _ in range(4)]  # fp16 rows into bf16 caches
    elementwise.store_kvcache(k, v, caches[0], caches[1], torch.arange(3))
    TWIN.store_kvcache(k, v, caches[2], caches[3], torch.arange(3))
    assert same(caches[:2], caches[2:])


@pytest.mark.parametrize("bad", [-1, 16])
def test_a_position_outside_cos_sin_is_refused(bad):
    q, k, _ = qkv_views(3, 2, 1, 64, torch.bfloat16)
    cos_sin = build_rope_cache(64, 16, 10000.0, None, "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match=rf"positions \[{bad}\] lie outside cos_sin's 16 rows"):
        elementwise.rotary(q, k, torch.tensor([0, bad, 2]), cos_sin)


def test_a_slot_past_the_caches_is_refused_before_anything_is_written():
    _, k, v = qkv_views(3, 2, 1, 64, torch.float32)
    k_cache, v_cache = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64)
    with pytest.raises(ValueError, match=r"slots \[8\] lie outside the KV caches' 8 slots"):
        elementwise.store_kvcache(k, v, k_cache, v_cache, torch.tensor([0, 8, -1]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize(("march", "needs"), PORTABLE)
def test_the_portable_c_matches_the_twin_too(march, needs, tmp_path, monkeypatch):
    """The loops for CPUs without AVX-512, built here for x86 CPUs that lack it."""
    if not load_portable_elementwise(march, needs, tmp_path, monkeypatch):
        return  # a CPU without them: built, not run
    for dtype in DTYPES:
        x, residual = randn(5, 100, dtype=dtype, seed=1), randn(5, 100, dtype=dtype, seed=2)
        weight = randn(100, dtype=dtype, seed=3)
        for out, twin in zip(elementwise.fused_add_rms_norm(x, residual, weight, 1e-5),
                             TWIN.fused_add_rms_norm(x, residual, weight, 1e-5), strict=True):
            assert_matches(out, twin)
        assert_matches(elementwise.rms_norm(x, weight, 1e-5), TWIN.rms_norm(x, weight, 1e-5))
        gate_up = randn(7, 2 * 72, dtype=dtype, scale=4, seed=4)
        assert_matches(elementwise.silu_and_mul(gate_up), TWIN.silu_and_mul(gate_up))
        q, k, _ = qkv_views(5, 3, 1, 72, dtype)
        cos_sin = build_rope_cache(72, 64, 10000.0, None, "cpu", dtype)
        positions = torch.tensor([9, 3, 63, 0, 10])
        for out, twin in zip(elementwise.rotary(q, k, positions, cos_sin), TWIN.rotary(q, k, positions, cos_sin),
                             strict=True):
            assert_matches(out, twin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_c", [True, False])
def test_argmax_in_c_and_without_it_is_torchs(dtype, in_c, monkeypatch):
    if not in_c:
        monkeypatch.setattr(elementwise, "load_elementwise", lambda: None)  # as where the library did not build
    g = torch.Generator().manual_seed(1)
    wide = torch.randint(-3, 3, (7, 1001 + 64), generator=g).to(dtype)
    x = wide[:, 32:1033]  # rows 1001 wide, a step of 1065 apart: odd sizes, not contiguous
    x[2, 999] = x[2, 3] = float("nan")
    x[4] = float("-inf")
    x[5, 1000] = 9
    assert elementwise.argmax(x).tolist() == x.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_of_a_steps_logits_in_threads_is_torchs(dtype):
    """Rows enough for the threads to share them (a step's logits), ties in every vector of 16, and
    zeros of both signs tied for the largest."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-40, 40, (48, 4099), generator=g).to(dtype) / 8
    x[7] = -1.0
    x[7, 70], x[7, 30] = 0.0, -0.0
    x[9, 4098] = 6.0
    x[11, 4097] = float("nan")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert elementwise.argmax(x).tolist() == x.argmax(-1).tolist()
    finally:
        torch.set_num_threads(threads)


def test_argmax_hands_what_c_does_not_take_to_the_twin(monkeypatch):
    monkeypatch.setattr(elementwise, "load_elementwise", _Untouchable)
    for x in (torch.randn(3, 64).half(), torch.randn(64, 3).t(), torch.zeros(0, 64)):  # fp16, column stride, no rows
        assert elementwise.argmax(x).tolist() == x.argmax(-1).tolist()

import pytest
import torch
from torch import nn

from batchapi.engine.model import linears
from batchapi.engine.model.linears import (
    BLOCK_ROWS,
    AmxBf16Linear,
    Avx512Bf16Linear,
    Bf16StoredLinear,
    InvariantLinear,
    PackedLinear,
    RowCounts,
    can_pack,
    invariant_layer,
    make_invariant,
    pack_linears,
    probe_input,
    probe_row_counts,
)
from batchapi.kernels.cpu import matmul, memory


def _linear(bias: bool, dtype=torch.bfloat16, in_features: int = 96) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, 160, bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_at_any_batch(bias):
    linear = _linear(bias)
    if not can_pack(linear):  # a CPU without oneDNN bf16: the model keeps its plain layer
        model = nn.Sequential(linear)
        assert pack_linears(model, batch_hint=64)["onednn"] == 0 and model[0] is linear
        return
    packed = PackedLinear.from_linear(linear, batch_hint=64)
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert torch.equal(packed(x), linear(x))


def test_pack_linears_keeps_shared_weights_and_skips_fp16():
    model = nn.ModuleDict({"a": _linear(False), "b": _linear(True, torch.float16), "emb": nn.Embedding(160, 96)})
    model["a"].weight = model["emb"].weight = nn.Parameter(torch.randn(160, 96).bfloat16(), requires_grad=False)
    if not can_pack(model["a"]):  # a CPU without oneDNN bf16: nothing is replaced
        assert pack_linears(model, batch_hint=8)["onednn"] == 0 and type(model["a"]) is nn.Linear
        return
    assert pack_linears(model, batch_hint=8)["onednn"] == 1
    assert isinstance(model["a"], PackedLinear) and type(model["b"]) is nn.Linear
    assert model["a"].weight is model["emb"].weight


@pytest.mark.parametrize("bf16_weights", [True, False])
def test_a_float32_layer_whose_weights_bf16_holds_keeps_them_in_bf16(bf16_weights):
    """A bf16 checkpoint in a float32 engine: the layer's values on half the bytes, and batch
    invariance leaves it as it is (one order a row at any count); a float32 layer bf16 would round
    stays oneDNN's."""
    torch.manual_seed(0)
    exact, rounded = nn.Linear(96, 160), nn.Linear(96, 160)
    exact.weight.data = exact.weight.data.bfloat16().float()
    model = nn.ModuleDict({"exact": exact, "rounded": rounded}).requires_grad_(False)
    x = torch.randn(7, 96)
    expected = exact(x)
    counts = pack_linears(model, batch_hint=8, bf16_weights=bf16_weights)
    if not bf16_weights:
        assert counts == {"bf16-stored": 0, "amx-bf16": 0, "avx512-bf16": 0, "onednn": 2}
        return
    assert counts == {"bf16-stored": 1, "amx-bf16": 0, "avx512-bf16": 0, "onednn": 1}
    stored = model["exact"]
    assert isinstance(stored, Bf16StoredLinear) and isinstance(model["rounded"], PackedLinear)
    assert stored.packed_weight.dtype == torch.bfloat16 and torch.equal(stored.weight, exact.weight)
    torch.testing.assert_close(stored(x), expected, rtol=1e-5, atol=1e-5)
    plan = make_invariant(model, torch.device("cpu"), max_tokens=64, max_logit_rows=64)
    assert model["exact"] is stored and plan["exact:96x160"] == 1


@pytest.mark.parametrize("amx", [False, True])
def test_a_bf16_layer_runs_the_avx512_bf16_kernel_where_the_cpu_has_it_and_no_amx(monkeypatch, amx):
    """Where the kernel is native and the CPU has no AMX (faked here on other CPUs: the kernel's plain-C
    build gives the same bits): the bf16 layer in C, left as it is by batch invariance, its weight
    kept once, packed; the embedding it is tied to keeps its own. With AMX (and no AMX build of the
    kernel), or the flag off: oneDNN."""
    monkeypatch.setattr(linears.matmul, "native_bf16", lambda: True)
    monkeypatch.setattr(linears.matmul, "native_amx", lambda: False)
    monkeypatch.setattr(linears, "_has_amx", lambda: amx)
    torch.manual_seed(0)
    model = nn.ModuleDict({"head": _linear(True), "emb": nn.Embedding(160, 96)}).requires_grad_(False)
    model["head"].weight = model["emb"].weight = nn.Parameter(torch.randn(160, 96).bfloat16(), requires_grad=False)
    x = torch.randn(7, 96).bfloat16()
    expected = model["head"](x)
    counts = pack_linears(model, batch_hint=8, bf16_weights=True)
    if amx:
        assert counts["avx512-bf16"] == 0 and not isinstance(model["head"], Avx512Bf16Linear)
        return
    assert counts == {"bf16-stored": 0, "amx-bf16": 0, "avx512-bf16": 1, "onednn": 0}
    layer = model["head"]
    assert isinstance(layer, Avx512Bf16Linear) and torch.equal(layer.weight, model["emb"].weight)
    assert layer.packed_weight.data_ptr() % memory.HUGE_PAGE == 0  # the arena's first tensor: in huge pages
    assert "weight" not in dict(layer.named_parameters())  # the packed copy is the layer's only one
    torch.testing.assert_close(layer(x).float(), expected.float(), rtol=1e-2, atol=0.05)
    assert torch.equal(layer(x[2:5]), layer(x)[2:5])
    plan = make_invariant(model, torch.device("cpu"), max_tokens=64, max_logit_rows=64)
    assert model["head"] is layer and plan["head:96x160"] == 1
    off = nn.ModuleDict({"head": _linear(True)}).requires_grad_(False)
    assert pack_linears(off, batch_hint=8, bf16_weights=False)["avx512-bf16"] == 0


def test_a_bf16_layer_runs_on_amx_tiles_where_the_kernel_has_them():
    """Where the kernel built with AMX and the OS grants the tiles: the bf16 layer on them, one call
    at any row count (batch invariance leaves it as it is), its weight kept once, packed. Elsewhere
    the kernel refuses and no layer is made one."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"head": _linear(True, torch.bfloat16, 96), "odd": _linear(True, torch.bfloat16, 80)})
    model.requires_grad_(False)
    x = torch.randn(40, 96).bfloat16()
    expected = model["head"](x)
    counts = pack_linears(model, batch_hint=8, bf16_weights=True)
    if not matmul.native_amx():
        assert counts["amx-bf16"] == 0 and not isinstance(model["head"], AmxBf16Linear)
        with pytest.raises(RuntimeError, match="refused"):
            matmul.linear_amx(x, matmul.pack_pairs(expected.new_zeros(16, 96)), 16, 96, None)
        return
    assert counts["amx-bf16"] == 1 and isinstance(model["head"], AmxBf16Linear)
    assert not isinstance(model["odd"], AmxBf16Linear)  # K = 80 is not whole 32-element chunks
    layer = model["head"]
    assert layer.packed_weight.data_ptr() % memory.HUGE_PAGE == 0  # the arena's first tensor: in huge pages
    assert "weight" not in dict(layer.named_parameters())
    torch.testing.assert_close(layer(x).float(), expected.float(), rtol=1e-2, atol=0.05)
    full = layer(x)
    for start, rows in ((0, 1), (3, 5), (7, 32), (1, 33)):
        assert torch.equal(layer(x[start : start + rows]), full[start : start + rows])
    plan = make_invariant(model, torch.device("cpu"), max_tokens=64, max_logit_rows=64)
    assert model["head"] is layer and plan["head:96x160"] == 1


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_fp32_linear_is_oneDNNs_sum_and_the_same_bits_at_any_batch(bias):
    linear = _linear(bias, torch.float32)
    assert can_pack(linear)  # fp32 needs no native bf16: every oneDNN build packs it
    packed = PackedLinear.from_linear(linear, batch_hint=64)
    x = torch.randn(300, 96)
    full = packed(x)
    torch.testing.assert_close(full, linear(x), rtol=1e-5, atol=1e-5)  # MKL's sums, up to the last bits
    for rows in (1, 7, 64, 299):
        assert torch.equal(packed(x[:rows]), full[:rows])


class SumsSplitAtSomeCounts(nn.Linear):
    """bf16 outputs of fp32 sums taken in another order (K in two halves) at the row counts in
    ``split``: as oneDNN's AMX kernel did for the test model's down_proj (512 -> 192) at some
    counts, where the old probe's random rows showed it at 168..191 rows only, which it never tried."""

    split = range(168, 192)

    def forward(self, x):
        w, x = self.weight.double(), x.double()  # fp64 sums rounded to fp32: the same bits on any CPU
        if x.shape[0] in self.split:
            half = x.shape[1] // 2
            out = (x[:, :half] @ w[:, :half].T).float() + (x[:, half:] @ w[:, half:].T).float()
        else:
            out = (x @ w.T).float()
        return out.to(self.weight.dtype)


def _split_sums(split: range) -> SumsSplitAtSomeCounts:
    layer = SumsSplitAtSomeCounts(512, 192, bias=False).bfloat16().requires_grad_(False)
    layer.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    layer.split = split
    return layer


def test_the_probe_finds_sums_taken_in_another_order_at_a_few_counts():
    assert probe_row_counts(_split_sums(range(168, 192)), 200) == RowCounts(192, 32)  # one call from 192 rows
    assert probe_row_counts(_split_sums(range(0)), 200) == RowCounts(1, 32)  # the same sums at every count


@torch.inference_mode()
def _assert_invariant(layer: nn.Module, max_rows: int) -> None:
    """Every count next to where the fake's sums change (33, 200) and every 7th count between."""
    x = probe_input(layer.weight, max_rows, seed=2)
    full = layer(x)
    for m in sorted({*range(1, 41), *range(41, max_rows, 7), *range(190, 211), max_rows - 1}):
        for start in {0, (37 * m) % (max_rows - m + 1), max_rows - m}:
            assert torch.equal(layer(x[start : start + m]), full[start : start + m]), (m, start)


def test_a_layer_whose_small_and_large_counts_agree_splits_the_counts_between():
    """As oneDNN's AMX kernel: the largest call's sums at 1..32 rows and from about N rows on."""
    linear = _split_sums(range(33, 200))
    counts = probe_row_counts(linear, 300)
    assert counts == RowCounts(200, 32)
    layer = invariant_layer(linear, counts)
    assert isinstance(layer, InvariantLinear) and layer.block_rows is None
    assert (layer.split_rows, layer.min_rows) == (32, 200)  # 33..199 rows: pieces of at most 32
    _assert_invariant(layer, 300)


def test_a_layer_whose_small_counts_differ_too_runs_in_fixed_blocks():
    linear = _split_sums(range(1, 200))
    counts = probe_row_counts(linear, 300)
    assert counts == RowCounts(None, 0)
    layer = invariant_layer(linear, counts)
    assert isinstance(layer, InvariantLinear) and layer.block_rows == BLOCK_ROWS
    _assert_invariant(layer, 300)


def test_the_probes_rows_show_another_order_of_the_sums_that_random_rows_hide():
    split, whole = _split_sums(range(1, 10**6)), _split_sums(range(0))
    probe_rows = probe_input(split.weight, 180, seed=1)
    random_rows = torch.randn(180, 512, generator=torch.Generator().manual_seed(1)).bfloat16()

    def rows_that_differ(x):
        return (split(x) != whole(x)).any(dim=1).float().mean().item()

    assert rows_that_differ(probe_rows) > 0.5
    assert rows_that_differ(random_rows) < 0.05

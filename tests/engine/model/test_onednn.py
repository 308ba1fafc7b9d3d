"""torch's private oneDNN ops, as engine.model.onednn calls them: they exist, take the arguments it
passes, give F.linear's results and a row the same bits at every row count. A torch upgrade that
changes them fails here by name, where the engine itself would only fall back to F.linear, slower.
Without them, or where they misbehave, no layer is packed and the fallback is logged once."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchapi.engine.model import onednn
from batchapi.engine.model.linears import PackedLinear, can_pack, pack_linears

TORCH = f"torch {torch.__version__}"
SIGNATURES = {  # positional argument types, as onednn.pack and onednn.linear pass them
    "_reorder_linear_weight": ["Tensor", "Optional[int]"],
    "_linear_pointwise": ["Tensor", "Tensor", "Optional[Tensor]", "str", "List[Optional[number]]", "Optional[str]"],
}
ROWS = (1, 2, 3, 7, 12, 33, 64, 299)


@pytest.fixture(autouse=True)
def fresh_answer():
    onednn.available.cache_clear()  # each test decides afresh, and leaves no answer behind
    yield
    onednn.available.cache_clear()


def layer(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(160, 96, generator=g).to(dtype)  # [out, in]
    return weight, torch.randn(160, generator=g).to(dtype) if bias else None


def test_torch_has_the_ops_with_the_arguments_the_engine_passes():
    assert torch.backends.mkldnn.is_available(), f"{TORCH} is built without oneDNN"
    for name in onednn.OPS:
        assert hasattr(torch.ops.mkldnn, name), f"{TORCH} has no torch.ops.mkldnn.{name}: see engine/model/onednn.py"
    for name, types in SIGNATURES.items():
        schema = getattr(torch.ops.mkldnn, name).default._schema
        assert [str(a.type) for a in schema.arguments] == types, f"{TORCH} changed torch.ops.mkldnn.{name}: {schema}"
        assert [str(r.type) for r in schema.returns] == ["Tensor"], f"{TORCH} changed torch.ops.mkldnn.{name}: {schema}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_self_check_passes_so_the_packed_path_runs(dtype):
    """Where bf16 is not native, bf16 layers stay on F.linear and the adapter says why (oneDNN would
    emulate bf16 there, or refuse it: "bf16 path needs the cpu support ...")."""
    if dtype == torch.bfloat16 and not onednn.bf16_native():
        assert onednn.unavailable(dtype) == onednn.NOT_NATIVE
        assert not onednn.available(dtype)
    else:
        assert onednn.unavailable(dtype) is None
        assert onednn.available(dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_linear_gives_f_linears_results(dtype, bias):
    weight, b = layer(dtype, bias)
    if dtype == torch.bfloat16 and not onednn.bf16_native():  # the engine never calls the ops here
        plain = nn.Linear(96, 160, bias=bias).to(dtype)
        assert not can_pack(plain)
        assert not any(pack_linears(nn.Sequential(plain), batch_hint=8).values())
        return
    packed = onednn.pack(weight, 64)
    tol = onednn.TOLERANCE[dtype]
    for rows in ROWS:
        x = torch.randn(rows, 96).to(dtype)
        torch.testing.assert_close(onednn.linear(x, packed, b), F.linear(x, weight, b), rtol=tol, atol=tol,
                                   msg=lambda m, rows=rows: f"{TORCH}, {rows} rows: {m}")


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_gets_the_same_bits_at_every_row_count(bias):
    """fp32, the dtype batch invariance relies on it for (linears.py): bf16 may differ at one row."""
    weight, b = layer(torch.float32, bias)
    packed = onednn.pack(weight, 64)
    x = torch.randn(300, 96)
    full = onednn.linear(x, packed, b)
    for rows in ROWS:
        assert torch.equal(onednn.linear(x[:rows], packed, b), full[:rows]), f"{TORCH}: other bits at {rows} rows"
        assert torch.equal(onednn.linear(x[-rows:], packed, b), full[-rows:]), f"{TORCH}: other bits at {rows} rows"


def fp32_linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 160).requires_grad_(False)


@pytest.mark.parametrize("change", ["an op is gone", "an op raises", "an op gives other results"])
def test_a_changed_torch_leaves_the_layers_on_f_linear_and_says_so_once(monkeypatch, caplog, change):
    if change == "an op is gone":
        monkeypatch.setattr(onednn, "OPS", (*onednn.OPS, "_gone_in_this_torch"))
    elif change == "an op raises":
        def raises(*args):
            raise RuntimeError("mkldnn::_linear_pointwise() expected at most 5 argument(s)")

        monkeypatch.setattr(onednn, "linear", raises)
    else:
        monkeypatch.setattr(onednn, "linear", lambda x, packed, bias: torch.zeros(x.shape[0], 48, dtype=x.dtype))
    model = nn.Sequential(fp32_linear(), fp32_linear())
    with caplog.at_level(logging.INFO, logger=onednn.__name__):
        assert not can_pack(model[0])
        assert pack_linears(model, batch_hint=8)["onednn"] == 0
    assert all(type(m) is nn.Linear for m in model)
    warnings = [r for r in caplog.records if r.name == onednn.__name__]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.text
    assert "F.linear" in warnings[0].getMessage() and TORCH in warnings[0].getMessage()


def test_the_packed_path_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger=onednn.__name__):
        model = nn.Sequential(fp32_linear(), fp32_linear())
        assert pack_linears(model, batch_hint=8)["onednn"] == 2
    assert all(isinstance(m, PackedLinear) for m in model)
    records = [r.getMessage() for r in caplog.records if r.name == onednn.__name__]
    assert records == [f"torch.float32 linear layers on CPU: oneDNN's packed weights ({TORCH})"]

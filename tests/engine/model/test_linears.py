import pytest
import torch
from torch import nn

from batchapi.engine.model.linears import PackedLinear, can_pack, pack_linears


def _linear(bias: bool, dtype=torch.bfloat16) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 160, bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_at_any_batch(bias):
    linear = _linear(bias)
    if not can_pack(linear):  # a CPU without oneDNN bf16: the model keeps its plain layer
        model = nn.Sequential(linear)
        assert pack_linears(model, batch_hint=64) == 0 and model[0] is linear
        return
    packed = PackedLinear.from_linear(linear, batch_hint=64)
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert torch.equal(packed(x), linear(x))


def test_pack_linears_keeps_shared_weights_and_skips_fp16():
    model = nn.ModuleDict({"a": _linear(False), "b": _linear(True, torch.float16), "emb": nn.Embedding(160, 96)})
    model["a"].weight = model["emb"].weight = nn.Parameter(torch.randn(160, 96).bfloat16(), requires_grad=False)
    if not can_pack(model["a"]):  # a CPU without oneDNN bf16: nothing is replaced
        assert pack_linears(model, batch_hint=8) == 0 and type(model["a"]) is nn.Linear
        return
    assert pack_linears(model, batch_hint=8) == 1
    assert isinstance(model["a"], PackedLinear) and type(model["b"]) is nn.Linear
    assert model["a"].weight is model["emb"].weight


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

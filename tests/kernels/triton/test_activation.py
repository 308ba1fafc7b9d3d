"""The Triton gated activations (kernels.triton.activation, interpreted on CPU) against their twin and
against transformers' arithmetic."""

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from batchapi.kernels import TORCH_OPS
from batchapi.kernels.triton import activation

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}  # exp's implementation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_twin(dtype):
    x = torch.randn(3, 2 * 1500).to(dtype)  # two column blocks, the second ragged
    torch.testing.assert_close(activation.silu_and_mul(x), TORCH_OPS.silu_and_mul(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_and_mul_matches_transformers(dtype):
    # gate spans the tails where tanh saturates and the middle where 1 - exp(-2|x|) cancels
    gate = torch.cat([torch.linspace(-12, 12, 1100), torch.randn(1100) * 2, torch.linspace(-1e-3, 1e-3, 800)])
    x = torch.stack([torch.cat([gate, torch.randn(3000)]), torch.randn(6000) * 3]).to(dtype)  # [2, 2I], I ragged
    gate, up = x.chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up  # transformers' GELUTanh, then the gated product
    out = activation.gelu_tanh_and_mul(x)
    assert out.shape == (2, 3000) and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_tanh_is_accurate_and_saturates():
    x = torch.cat([torch.linspace(-50, 50, 999), torch.tensor([0.0, -0.0, 1e-30, -1e-7, 88.0, -1e4])])
    torch.testing.assert_close(_tanh(x), torch.tanh(x), atol=2e-7, rtol=0)


def test_gelu_tanh_and_mul_checks_its_input():
    with pytest.raises(AssertionError, match=r"\[N, 2I\]"):
        activation.gelu_tanh_and_mul(torch.randn(2, 7))
    with pytest.raises(AssertionError, match="contiguous"):
        activation.gelu_tanh_and_mul(torch.randn(8, 4).T)
    assert activation.gelu_tanh_and_mul(torch.randn(0, 8)).shape == (0, 4)


def _tanh(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _tanh_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return out


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, activation.tanh(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)

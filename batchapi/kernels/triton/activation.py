"""Gated activations of the fused gate/up projection (SiLU: Llama; GELU-tanh: Gemma), rounding where
transformers' MLPs round, and tanh for the kernels that need one."""

import torch
import triton
import triton.language as tl

from batchapi.kernels.triton.launch import check_last_dim_contiguous, check_launchable

BLOCK = 1024


@triton.jit
def tanh(x):
    """fp32 tanh from exp (libdevice's does not run under Triton's interpreter); exp of -2|x| never
    overflows, and the cancellation of 1 - t near 0 costs an ulp of 1, not of tanh."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _act_and_mul_kernel(out_ptr, x_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if GELU:  # tanh-approximated, as gelu_pytorch_tanh
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))  # sqrt(2 / pi): torch's kBeta
        act = 0.5 * g * (1.0 + tanh(inner))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(gate.dtype).to(tl.float32)  # F.silu and F.gelu round to the dtype before the product
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(gate.dtype), mask=ok)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [N, 2I], got {tuple(x.shape)}"
    check_last_dim_contiguous(x=x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        check_launchable(_act_and_mul_kernel, x)
        _act_and_mul_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](out, x, inter, x.stride(0), out.stride(0),
                                                                     BLOCK=BLOCK, GELU=gelu)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] (gate then up) -> gelu(gate, approximate="tanh") * up [N, I]."""
    return _act_and_mul(x, gelu=True)

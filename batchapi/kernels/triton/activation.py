"""SiLU-and-mul of the fused gate/up projection, rounding where transformers' LlamaMLP rounds."""

import torch
import triton
import triton.language as tl

from batchapi.kernels.triton.launch import check_last_dim_contiguous, check_launchable


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(gate.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] (gate then up) -> [N, I]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [N, 2I], got {tuple(x.shape)}"
    check_last_dim_contiguous(x=x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    block = 1024
    if x.shape[0]:
        check_launchable(_silu_and_mul_kernel, x)
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            out, x, inter, x.stride(0), out.stride(0), BLOCK=block,
        )
    return out

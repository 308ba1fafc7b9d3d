"""RMSNorm and fused residual-add + RMSNorm, rounding where transformers' LlamaRMSNorm rounds."""

import torch
import triton
import triton.language as tl

from batchapi.kernels.triton.launch import (
    check_last_dim_contiguous,
    check_launchable,
    check_same_device,
    next_pow2,
)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [N, H]
    sum_ptr,  # [N, H], x + residual (written only with HAS_RESIDUAL)
    x_ptr,  # [N, H]
    residual_ptr,  # [N, H]
    weight_ptr,  # [H]
    eps,
    hidden,
    stride_o, stride_s, stride_x, stride_r,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # the sum is rounded to the activation dtype before the norm reads it, as in HF
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x, residual, weight, eps):
    assert x.dim() == 2, f"x must be [N, H], got {tuple(x.shape)}"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)} for hidden {x.shape[1]}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
    check_last_dim_contiguous(x=x, weight=weight, **({"residual": residual} if residual is not None else {}))
    check_same_device(x, weight, *([residual] if residual is not None else []))
    out_dtype = torch.promote_types(weight.dtype, x.dtype)  # HF: weight * normed.to(x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    if x.shape[0]:
        check_launchable(_rms_norm_kernel, x)
        _rms_norm_kernel[(x.shape[0],)](
            out, summed, x, residual if residual is not None else x, weight, eps, x.shape[1],
            out.stride(0), summed.stride(0), x.stride(0), (residual if residual is not None else x).stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_H=next_pow2(x.shape[1]),
            num_warps=min(16, max(1, next_pow2(x.shape[1]) // 512)),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] -> [N, H]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both [N, H]."""
    return _launch(x, residual, weight, eps)

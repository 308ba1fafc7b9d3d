"""Rotary embedding (neox halves layout) applied to q and k, rounding where transformers rounds."""

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
def _rotate_heads(src_ptr, dst_ptr, stride_src, stride_dst, token, cos, sin, num_heads,
                  HEADS_P2: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    ok = heads < num_heads
    base = src_ptr + token * stride_src + heads * (2 * HALF) + dims
    x1 = tl.load(base, mask=ok, other=0.0)  # [H, D/2]
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    # each product rounded to the activation dtype, then the sum, as x * cos + rotate_half(x) * sin in HF
    a1 = (x1.to(tl.float32) * cos).to(dt).to(tl.float32)
    b1 = (x2.to(tl.float32) * sin).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin).to(dt).to(tl.float32)
    out = dst_ptr + token * stride_dst + heads * (2 * HALF) + dims
    tl.store(out, (a1 - b1).to(dt), mask=ok)
    tl.store(out + HALF, (a2 + b2).to(dt), mask=ok)


@triton.jit
def _rotary_kernel(
    q_out_ptr, k_out_ptr,  # [N, Hq, D], [N, Hkv, D] contiguous
    q_ptr, k_ptr,  # same shapes; heads contiguous within a token
    positions_ptr,  # [N]
    cos_sin_ptr,  # [max_pos, D]
    stride_q, stride_k, stride_qo, stride_ko, stride_cs,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr,
    QH_P2: tl.constexpr,
    KH_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    # the cache is rounded to the activation dtype first, as HF's rotary module returns it
    dt = q_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims).to(dt).to(tl.float32)  # [1, D/2]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims).to(dt).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_q, stride_qo, token, cos, sin, num_q_heads, QH_P2, HALF)
    _rotate_heads(k_ptr, k_out_ptr, stride_k, stride_ko, token, cos, sin, num_kv_heads, KH_P2, HALF)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hkv, D], positions [N], cos_sin [max_pos, D] -> rotated (q, k), new tensors."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0], f"q {tuple(q.shape)} / k {tuple(k.shape)}"
    head_dim = q.shape[2]
    assert k.shape[2] == head_dim and cos_sin.shape[1] == head_dim, f"head dims q/k/cos_sin {head_dim}/{k.shape[2]}/{cos_sin.shape[1]}"
    assert head_dim == next_pow2(head_dim) >= 4, f"head dim {head_dim} must be a power of 2"
    assert positions.shape == (q.shape[0],), f"positions {tuple(positions.shape)} for {q.shape[0]} tokens"
    assert q.dtype == k.dtype, f"q {q.dtype} and k {k.dtype} differ"
    assert q.stride(1) == head_dim and k.stride(1) == head_dim, "heads must be contiguous within a token"
    check_last_dim_contiguous(q=q, k=k, cos_sin=cos_sin)
    check_same_device(q, k, positions, cos_sin)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        check_launchable(_rotary_kernel, q)
        _rotary_kernel[(q.shape[0],)](
            q_out, k_out, q, k, positions.contiguous(), cos_sin,
            q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0), cos_sin.stride(0),
            q.shape[1], k.shape[1],
            HALF=head_dim // 2, QH_P2=next_pow2(q.shape[1]), KH_P2=next_pow2(k.shape[1]),
        )
    return q_out, k_out

"""A batch-invariant matmul in Triton: y = x @ w.T (+ bias), the linear layers on CUDA with invariance on.

cuBLAS picks its kernel, tiles and split-K by the shape, so a row's bits depend on how many rows
the call has. Here every call uses the same tiles (BLOCK_M x BLOCK_N output tiles, K walked in
BLOCK_K steps, in order, into one fp32 accumulator, no split along K), so each output element is
the same sum in the same order whatever M is. The kernel is persistent: NUM_PROGRAMS programs
(the SM count) walk the tiles, so a launch costs the same whatever the row count.
"""

import functools

import torch
import triton
import triton.language as tl

from batchapi.kernels.triton.launch import check_launchable, check_same_device

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64  # fixed: the invariance rests on them not depending on M
NUM_WARPS, NUM_STAGES = 8, 3  # 4 warps spill at these tiles (ptxas, sm_90)


@triton.jit(do_not_specialize=["m"])
def _matmul_kernel(
    y_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] (HAS_BIAS)
    m, n, k,
    stride_ym, stride_xm, stride_wn,
    HAS_BIAS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv(n, BLOCK_N)
    num_tiles = tl.cdiv(m, BLOCK_M) * tiles_n
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < m, cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(x, w, acc, input_precision="ieee" if x.dtype == tl.float32 else "tf32")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _num_programs(device_index: int | None) -> int:
    if torch.cuda.is_available() and device_index is not None:
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 4  # Triton's interpreter (the tests): any count gives the same result


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias [N] -> [M, N] in x's dtype, each row's bits independent of M."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    assert x.dtype == weight.dtype, f"x is {x.dtype}, weight {weight.dtype}"
    check_same_device(x, weight, *([bias] if bias is not None else []))
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    check_launchable(_matmul_kernel, x)
    programs = _num_programs(x.device.index if x.is_cuda else None)
    _matmul_kernel[(programs,)](
        y, x, weight, bias if bias is not None else weight, m, n, k,
        y.stride(0), x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, NUM_PROGRAMS=programs,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return y

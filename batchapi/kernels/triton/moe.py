"""The fused mixture-of-experts MLP in Triton: a grouped GEMM over the tokens routed to each expert.

As vLLM's and SGLang's fused_moe: the (token, slot) pairs are sorted by expert on the device and each
expert's segment is padded to a multiple of BLOCK_M (``align_block_size``), so every BLOCK_M-row
block belongs to one expert. One kernel, launched twice, computes BLOCK_M x BLOCK_N tiles of a
block's rows times its expert's weights:
- gate/up (GATED): x's rows gathered by token, a gate and an up accumulator, silu(gate) * up in the
  epilogue, rounding as the twin's silu_and_mul does -> the activations, in padded sorted order;
- down: the activations' rows, the routing weight multiplied in the epilogue, each row stored to its
  slot -> [T * k, H]; a token's slots are then summed in slot order (torch, k - 1 adds).
Batch invariance: the tiles are fixed, K is walked in BLOCK_K steps in order into one fp32
accumulator, no split-K, so a row's bits do not depend on how many rows its expert got. Nothing is
read back to the host: the grid covers the most blocks the routing can fill, the rest exit at once.
"""

import torch
import triton
import triton.language as tl

from batchapi.kernels.torch.moe import check_moe_args
from batchapi.kernels.triton.launch import check_last_dim_contiguous, check_launchable, check_same_device

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # fixed: the invariance rests on them not depending on the routing
NUM_WARPS, NUM_STAGES = 8, 3  # 4 warps spill (ptxas, sm_90), as do 4 stages in fp32


@triton.jit(do_not_specialize=["num_slots"])
def _moe_gemm_kernel(
    out_ptr,  # GATED: [P, N] in padded sorted order; else [num_slots, N] by slot
    a_ptr,  # GATED: x [T, K]; else the activations [P, K] in padded sorted order
    w_ptr,  # [E, N, K]; GATED: [E, 2N, K], gate rows then up rows
    weights_ptr,  # [num_slots] routing weights (not GATED)
    sorted_ids_ptr,  # [P] int32: the slot t * k + s of each padded row, num_slots for padding
    block_experts_ptr,  # [P / BLOCK_M] int32: the expert of each block
    num_padded_ptr,  # [1]: the rows of P the routing fills
    num_slots, n, k, top_k,
    stride_om, stride_am, stride_we, stride_wn,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the padded order
    slots = tl.load(sorted_ids_ptr + rows)
    row_ok = slots < num_slots
    if GATED:  # gate/up reads x by token, down the activations where gate/up stored them
        a_rows = slots // top_k
    else:
        a_rows = rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + tl.load(block_experts_ptr + block).to(tl.int64) * stride_we

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED only
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = col_ok[None, :] & k_ok[:, None]
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee" if a.dtype == tl.float32 else "tf32")  # [BLOCK_M, BLOCK_N]
        if GATED:
            w_up = tl.load(w_base + (cols[None, :] + n).to(tl.int64) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee" if a.dtype == tl.float32 else "tf32")

    # each step rounded to the output's dtype, as the twin's torch ops round
    dtype = out_ptr.dtype.element_ty
    h = acc.to(dtype).to(tl.float32)
    if GATED:
        act = (h / (1.0 + tl.exp(-h))).to(dtype).to(tl.float32)  # F.silu rounds to the dtype
        result = act * acc_up.to(dtype).to(tl.float32)
        out_rows = rows
    else:
        result = h * tl.load(weights_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        out_rows = slots
    tl.store(out_ptr + out_rows[:, None].to(tl.int64) * stride_om + cols[None, :], result.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [P] int32, block_experts [P / block_m] int32, num_padded [1]).

    The slots t * k + s sorted by expert (stable: in slot order within one), each expert's segment
    padded with num_slots = T * k to a multiple of block_m; P is the most rows any routing of T * k
    slots can fill, so nothing depends on a read-back. Blocks past num_padded are not to be run."""
    flat = topk_ids.flatten()  # [T * k]
    num_slots = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E]; bincount would read its length back
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E]: where each expert's padded segment ends
    first = counts.cumsum(0) - counts  # where each segment starts, unpadded
    experts = flat[order]
    dest = ends[experts] - padded[experts] + torch.arange(num_slots, device=flat.device) - first[experts]
    capacity = triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts.to(torch.int32), ends[-1:]


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32 or x.dtype
    topk_ids: torch.Tensor,  # [T, k] int64, each in [0, E)
) -> torch.Tensor:
    """-> [T, H] in x.dtype, as kernels.torch.moe.fused_moe; each token's bits independent of the batch."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    check_same_device(x, w13, w2, topk_weights, topk_ids)
    check_last_dim_contiguous(x=x, w13=w13, w2=w2)
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    if tokens == 0:
        return x.new_empty(0, hidden)
    check_launchable(_moe_gemm_kernel, x)
    sorted_ids, block_experts, num_padded = align_block_size(topk_ids, experts, BLOCK_M)
    num_slots, blocks = tokens * top_k, block_experts.numel()
    weights = topk_weights.contiguous().view(-1)  # [T * k]
    tiling = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)

    act = x.new_empty(sorted_ids.numel(), inter)  # [P, I] in padded sorted order
    _moe_gemm_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        act, x, w13, weights, sorted_ids, block_experts, num_padded, num_slots, inter, hidden, top_k,
        act.stride(0), x.stride(0), w13.stride(0), w13.stride(1), GATED=True, **tiling,
    )
    scaled = x.new_empty(tokens, top_k, hidden)  # [T, k, H] each slot's weighted expert output
    _moe_gemm_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        scaled, act, w2, weights, sorted_ids, block_experts, num_padded, num_slots, hidden, inter, top_k,
        hidden, act.stride(0), w2.stride(0), w2.stride(1), GATED=False, **tiling,
    )
    out = scaled[:, 0]
    for slot in range(1, top_k):  # in slot order: the same sum for a token in any batch
        out = out + scaled[:, slot]
    return out

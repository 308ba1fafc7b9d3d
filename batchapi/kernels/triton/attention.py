"""Paged attention in Triton: one kernel for decode, chunked prefill and prefill on a cached prefix,
with an optional sliding window and Gemma 2's score soft-cap.

A program takes one block of query positions of one sequence and all GROUP query heads sharing
one KV head (rows = positions x heads), and walks that sequence's KV through its block table in
tiles with an online softmax, from the tile holding its first row's window start (0 without a
window) to its last row's causal end. Tiles are counted from position 0 whatever the window, so
a row meets the same tiles in every program; the tiles a row walks before its own window starts
or after its causal end see only -inf scores and leave its softmax state bit for bit as it was
(batch invariance). Blocks before the window start of a sequence's first query may be freed
(their table entries -1 or reused): no lane reads them. Sequences are found from the program id
by a binary search over cu_seqlens_q, so the launch needs no host-side list of sequences. With
num_splits > 1 (long contexts at small batch) each program covers one slice of the tiles in its
window and a second kernel merges the slices. The twin is kernels.torch.attention.paged_attention.
"""

import functools
import weakref

import torch
import triton
import triton.language as tl

from batchapi.kernels.triton.activation import tanh
from batchapi.kernels.triton.launch import (
    check_last_dim_contiguous,
    check_launchable,
    check_same_device,
    next_pow2,
)

NO_WINDOW = 2**30  # window 0 (the whole context) as the kernel takes it: longer than any context


# num_seqs: a loop bound below, it must not become constexpr 1; window: one compile for every window
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D], or the split partials [T, Hq, S, D] fp32
    max_ptr,  # [T, Hq, S] fp32 (splits only)
    sum_ptr,  # [T, Hq, S] fp32 (splits only)
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B+1] int32
    context_lens_ptr,  # [B] int32
    scale,
    window,  # keys visible to a row at position p: p - window < kv_pos <= p
    softcap,
    num_seqs,
    num_heads,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    qblock = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- which sequence: sequence b owns program ids [cu[b] // BLOCK_Q + b, cu[b+1] // BLOCK_Q + b + 1),
    #    at least ceil(q_len / BLOCK_Q) of them (spares return at once); binary search for the owner
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= qblock:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_qblock = qblock - (q_start // BLOCK_Q + seq)
    if local_qblock * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    # -- rows: BLOCK_Q positions x GROUP heads
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_pos = local_qblock * BLOCK_Q + offs_m // GROUP  # position within this step's queries
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    token = (q_start + q_pos).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # [BLOCK_M, D]
    abs_pos = context_len - q_len + q_pos  # position of each row in the whole sequence

    # -- this program's KV range: from the window start of its first row (the blocks before the
    #    window of the sequence's first row may be freed: never load them) to the causal end of its
    #    last row, in tiles counted from 0 so that a row meets the same tiles in every program;
    #    cut into NUM_SPLITS slices of tiles
    kv_lo = tl.maximum(context_len - q_len + local_qblock * BLOCK_Q - window + 1, 0)
    kv_end = tl.minimum(context_len, context_len - q_len + (local_qblock + 1) * BLOCK_Q)
    first_tile = kv_lo // TILE
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, TILE) - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(kv_end, TILE))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE + tl.arange(0, TILE)
        kv_ok = (kv_pos >= kv_lo) & (kv_pos < kv_end)
        block = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot_in_block = kv_pos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + block[None, :] * stride_kb + slot_in_block[None, :] * stride_ks
            + kv_head * stride_kh + offs_d[:, None],
            mask=kv_ok[None, :], other=0.0,
        )  # [D, TILE]
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_vb + slot_in_block[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :],
            mask=kv_ok[:, None], other=0.0,
        )  # [TILE, D]
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE] fp32
        if USE_SOFTCAP:  # Gemma 2: softcap * tanh(s * scale / softcap)
            s = softcap * tanh(s * (scale / softcap))
        else:
            s = s * scale
        behind = abs_pos[:, None] - kv_pos[None, :]  # how far each key lies behind each row
        visible = row_ok[:, None] & kv_ok[None, :] & (behind >= 0) & (behind < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # -- epilogue: normalised output, or this slice's partials for the merge kernel
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None],
        )
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split  # index into [T, Hq, S]
        tl.store(out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(max_ptr + part, m_i, mask=row_ok)
        tl.store(sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_ptr,  # [T, Hq, S, D] fp32
    max_ptr,  # [T, Hq, S] fp32
    sum_ptr,
    num_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * num_heads + head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.load(max_ptr + row * NUM_SPLITS + offs_s)  # [S]
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_all)  # [S], 0 for empty slices
    total = tl.sum(w * tl.load(sum_ptr + row * NUM_SPLITS + offs_s), axis=0)
    part = tl.load(part_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :])  # [S, D]
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens):
    assert q.dim() == 3 and k_cache.dim() == 4, f"q {tuple(q.shape)} / k_cache {tuple(k_cache.shape)} rank"
    assert k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    num_kv_heads, head_dim = k_cache.shape[2:]
    assert q.shape[2] == head_dim, f"q head dim {q.shape[2]} != cache head dim {head_dim}"
    assert head_dim in (64, 128) or head_dim == next_pow2(head_dim) >= 16, f"unsupported head dim {head_dim}"
    assert q.shape[1] % num_kv_heads == 0, f"Hq={q.shape[1]} not a multiple of Hkv={num_kv_heads}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes q {q.dtype} k {k_cache.dtype} v {v_cache.dtype}"
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    num_seqs = context_lens.shape[0]
    assert cu_seqlens_q.shape == (num_seqs + 1,), f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} for {num_seqs} seqs"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, f"block_tables {tuple(block_tables.shape)}"
    assert block_tables.stride(1) == 1 and cu_seqlens_q.is_contiguous() and context_lens.is_contiguous(), (
        "block_tables rows, cu_seqlens_q and context_lens must be contiguous"
    )
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    check_same_device(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)


@functools.cache
def _tiling(group: int, head_dim: int, decode: bool) -> tuple:
    if decode:  # left alone ptxas takes ~150 registers (one program an SM); 128 hold it without spills to D=128
        return max(16, next_pow2(group)), 32, 4 if head_dim <= 64 else 8, 128 if head_dim <= 128 else None
    wide = head_dim > 128  # Gemma's 256: 64 x 64 tiles of it spill ~700 bytes
    return max(32 if wide else 64, next_pow2(group)), 32 if wide else 64, 8, None


def launch_tiling(group: int, head_dim: int, max_seqlen_q: int) -> dict:
    """Rows per program (BLOCK_M = BLOCK_Q positions x GROUP heads), KV tile, warps and register cap.

    Picked by ptxas register counts for sm_90 (no spills; at most 128 registers for decode up to
    D=128, so two programs share an SM), not yet by timings on a GPU.
    """
    block_m, tile, warps, maxnreg = _tiling(group, head_dim, max_seqlen_q <= 4)
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE=tile, num_warps=warps, num_stages=2, maxnreg=maxnreg)


def _choose_splits(num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_context_len: int, tile: int) -> int:
    # split only pure-decode steps whose (sequence, kv head) programs cannot fill the GPU
    if max_seqlen_q != 1 or num_seqs * num_kv_heads >= 256 or max_context_len < 8 * tile:
        return 1
    return min(16, next_pow2(max(1, max_context_len // (4 * tile))))


_last_step: dict = {}


def _step_maxima(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> tuple[int, int]:
    """Longest query run and context of a step, read from the device once per step, not per layer.

    The engine passes the same metadata tensors to every layer of a step; holding a weak reference
    to the last ones seen tells a new step's tensors from the same ones again.
    """
    ref = _last_step.get("tensors")
    if ref is not None and ref[0]() is cu_seqlens_q and ref[1]() is context_lens:
        return _last_step["maxima"]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    maxima = tuple(torch.stack([q_lens.max(), context_lens.max()]).tolist())
    _last_step.update(tensors=(weakref.ref(cu_seqlens_q), weakref.ref(context_lens)), maxima=maxima)
    return maxima


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    max_seqlen_q: int | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; see docs/CONTRACTS.md.

    window > 0: a query at position p sees the keys at p - window + 1 .. p (transformers' sliding
    window); the blocks before the window of a sequence's first query may be freed (table entry -1,
    or a block now another's) and are never read. softcap > 0: scores s become softcap * tanh(s /
    softcap) before the mask and the softmax (Gemma 2).

    max_seqlen_q / max_context_len: the step's longest query run and context, known on the host
    by the engine; without them they are read from the device once per step. They choose the
    tiling and the split only: any values give the same result. num_splits forces the split-KV
    path (a power of 2; 1 turns it off).

    invariant: batch invariance. One tiling for every step (the decode one: the same KV tiles and
    the same dot shapes for a token in a prefill, a chunk or a decode step) and no split, so that
    each query row walks its context in the same tiles, in order, in every step.
    """
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    assert window >= 0 and softcap >= 0.0, f"window {window} and softcap {softcap} must be >= 0"
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None or (num_splits is None and max_seqlen_q == 1 and max_context_len is None):
        max_seqlen_q, max_context_len = _step_maxima(cu_seqlens_q, context_lens)
    tiling = launch_tiling(group, head_dim, 1 if invariant else max_seqlen_q)
    if invariant:
        num_splits = 1
    if num_splits is None:
        kv_len = min(max_context_len or 0, window or NO_WINDOW)  # what a decode row reads
        num_splits = _choose_splits(num_seqs, num_kv_heads, max_seqlen_q, kv_len, tiling["TILE"])
    assert num_splits == next_pow2(num_splits), f"num_splits must be a power of 2, got {num_splits}"
    grid = (num_tokens // tiling["BLOCK_Q"] + num_seqs, num_kv_heads, num_splits)
    if num_splits == 1:
        target, maxes, sums = out, out, out
    else:
        target = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        maxes = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
    check_launchable(_paged_attention_kernel, q)
    _paged_attention_kernel[grid](
        target, maxes, sums, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        scale, window or NO_WINDOW, softcap, num_seqs, num_heads,
        q.stride(0), q.stride(1),
        target.stride(0), target.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=num_splits, USE_SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **tiling,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, target, maxes, sums, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        )
    return out

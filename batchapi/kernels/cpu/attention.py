"""Paged attention on CPU: decode tokens through the C kernel (csrc/paged_decode.c), the rest through the twin.

The torch twin gathers every decode sequence's blocks into a padded copy before its SDPA; on a
small CPU that copy and SDPA's per-head overhead cost a quarter of a decode step at 100 tokens
of context, more at longer ones. The C kernel reads the blocks where they lie, once, for all
query heads of a KV head. A short prefill run (up to PREFILL_ROWS_IN_C query tokens: chat
prompts past their cached prefix) goes to the same kernel as one row per token, each with its
own causal context length; a longer one keeps the twin's SDPA, whose matmuls win there.
Tensors the kernel does not take (fp16, block size over 32, more than 16 query heads a KV head,
head size over 256) go to the twin whole.

A sliding window starts each row's walk at its window's first key: the blocks before it may be
freed and are neither checked nor read. A soft cap is applied to the scaled scores in the kernel.

Batch invariant (``invariant=True``, the engine's default): every query token goes to the C kernel,
prefill runs of any length included, so that a token's attention is one computation whatever step
it is in: its context (its window) in the same chunks of the same blocks, in order, with one
online softmax (the chunks are those of the block layout from its first key on, fixed per
position). Long prefills then cost more than through SDPA's matmuls (see the engine's benchmark).
Tensors the kernel does not take go to the twin's invariant path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from batchapi.kernels.cpu import build
from batchapi.kernels.torch import attention as twin

PREFILL_ROWS_IN_C = 64  # longest prefill run sent to the C kernel; per row it costs a decode token's attention
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 32  # as in csrc/paged_decode.c


@dataclass
class _Plan:
    key: tuple  # the step's metadata tensors (held, so their ids stay theirs)
    pool: tuple[int, int]  # (num_blocks, block_size) of the caches the tables were checked against
    num_tokens: int
    # the C kernel's rows: decode tokens and the tokens of short prefill runs, one query row each
    rows: torch.Tensor  # [R] int32, 0..R-1
    tables: torch.Tensor  # [R, max_blocks] int32: the block table of each row's sequence
    q_rows: torch.Tensor  # [R + 1] int32: each row's token in q (its "cu_seqlens_q"), then T
    context_lens: torch.Tensor  # [R] int32: the keys each row attends to (causal within a prefill)
    prefills: list[tuple[int, int, int, int]]  # the twin's: (sequence, first token, tokens, context length)
    # the windows whose blocks _check_tables found in the pool: a step's layers may alternate
    # windowed and global ones, and a global layer reads blocks a window lets go
    checked: set[int] = field(default_factory=set)


_last_plan: _Plan | None = None


def _plan(block_tables, cu_seqlens_q, context_lens, num_blocks: int, block_size: int, invariant: bool,
          window: int) -> _Plan:
    # every layer of a step passes the same metadata tensors: plan once, on the first layer, and
    # check the tables once for each window the layers use
    global _last_plan
    key = (block_tables, cu_seqlens_q, context_lens, invariant)
    plan = _last_plan
    if (plan is None or plan.pool != (num_blocks, block_size)
            or any(a is not b for a, b in zip(plan.key, key, strict=True))):
        plan = _last_plan = _make_plan(key, block_tables, cu_seqlens_q, context_lens, num_blocks, block_size,
                                       invariant)
    if window not in plan.checked:
        _check_tables(plan, num_blocks, block_size, window)
        plan.checked.add(window)
    return plan


def _make_plan(key, block_tables, cu_seqlens_q, context_lens, num_blocks: int, block_size: int,
               invariant: bool) -> _Plan:
    """The C kernel's rows, in whole-array ops (a step's prefill has thousands of tokens): every
    decode token, and each token of a prefill run no longer than the limit, with its causal
    context length; longer runs go to the twin."""
    starts = cu_seqlens_q.numpy().astype(np.int64)
    q_lens = starts[1:] - starts[:-1]
    if starts[0] != 0 or (q_lens < 0).any():
        raise ValueError("cu_seqlens_q must start at 0 and never decrease")
    if (q_lens == 1).all() and min(block_tables.shape[0], context_lens.shape[0]) >= len(q_lens):
        # a decode step: a row a sequence, the tensors as they come (where they cover every sequence;
        # else the general path's indexing refuses them)
        return _Plan(key, (num_blocks, block_size), int(starts[-1]), torch.arange(len(q_lens), dtype=torch.int32),
                     block_tables.to(torch.int32).contiguous(), cu_seqlens_q.to(torch.int32).contiguous(),
                     context_lens.to(torch.int32).contiguous(), [])
    ctx = context_lens.numpy().astype(np.int64)
    longest = q_lens.max(initial=0) if invariant else PREFILL_ROWS_IN_C
    in_c = np.flatnonzero((q_lens > 0) & (q_lens <= longest))  # sequences whose tokens the kernel takes
    n = q_lens[in_c]
    seqs = np.repeat(in_c, n)  # the sequence of each row
    first = np.cumsum(n) - n  # each sequence's first row
    local = np.arange(len(seqs)) - np.repeat(first, n)  # a row's place in its run
    q_rows = starts[seqs] + local
    lens = ctx[seqs] - np.repeat(n, n) + 1 + local  # causal: a run's k-th token sees ctx - n + 1 + k keys
    prefills = [(b, int(starts[b]), int(q_lens[b]), int(ctx[b])) for b in np.flatnonzero(q_lens > longest).tolist()]
    plan = _Plan(key, (num_blocks, block_size), int(starts[-1]), torch.arange(len(seqs), dtype=torch.int32),
                 block_tables.to(torch.int32)[torch.from_numpy(seqs)].contiguous(),
                 torch.from_numpy(np.append(q_rows, starts[-1]).astype(np.int32)),
                 torch.from_numpy(lens.astype(np.int32)), prefills)
    return plan


TABLE_ERRORS = {1: "a query token has an empty context", 2: "a block table is shorter than its context",
                3: "a block table holds an id outside the KV pool of {} blocks within its window"}


def _check_tables(plan: _Plan, num_blocks: int, block_size: int, window: int) -> None:
    """The C kernel trusts the block tables: a bad id would read outside the pool, so check the
    blocks each row's window covers (its context where window is 0), once a step, before any layer
    reads them; the entries before a window may be freed (-1). In C (paged_check_tables): a dozen
    torch ops on the tables took a tenth of a millisecond a step.
    Raised, not asserted, so that ``python -O`` keeps the check."""
    rows = plan.rows.numel()
    if not rows:
        return
    tables = plan.tables
    rc = build.load().paged_check_tables(tables.data_ptr(), tables.stride(0), tables.shape[1],
                                         plan.context_lens.data_ptr(), rows, block_size, window, num_blocks)
    if rc != 0:
        raise ValueError(TABLE_ERRORS[rc].format(num_blocks))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, pad -1
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32, KV length including this step's tokens
    scale: float,
    invariant: bool = False,
    *,
    window: int = 0,
    softcap: float = 0.0,
    **hints,
) -> torch.Tensor:
    """Same contract as the twin, kernels.torch.attention.paged_attention (docs/CONTRACTS.md);
    invariant: every token through the C kernel (see the module's docstring)."""
    assert q.shape[1] % k_cache.shape[2] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}"
    assert window >= 0 and softcap >= 0, f"window {window} and softcap {softcap} must be >= 0 (0: none)"
    if q.shape[0] == 0 or cu_seqlens_q.shape[0] < 2 or build.load() is None or not supports(q, k_cache, v_cache):
        fallback = twin.invariant_paged_attention if invariant else twin.paged_attention
        return fallback(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=window,
                        softcap=softcap, **hints)
    plan = _plan(block_tables, cu_seqlens_q, context_lens, k_cache.shape[0], k_cache.shape[1], invariant, window)
    assert plan.num_tokens == q.shape[0], f"cu_seqlens_q ends at {plan.num_tokens}, q has {q.shape[0]} tokens"
    q = q.contiguous()
    out = torch.empty_like(q)
    if plan.rows.numel():
        _decode_rows(plan, q, k_cache, v_cache, out, scale, window, softcap)
    for b, s, n, ctx in plan.prefills:
        out[s : s + n] = twin.prefill_attention(q[s : s + n], k_cache, v_cache, block_tables[b], ctx, scale,
                                                window=window, softcap=softcap)
    return out


def _decode_rows(plan: _Plan, q, k_cache, v_cache, out, scale: float, window: int, softcap: float) -> None:
    """paged_decode of the plan's rows without its checks: the plan's tensors are ours (made and
    checked once a step), q and the caches passed supports() and out is a fresh empty_like(q)."""
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    rows = plan.rows.numel()
    rc = getattr(build.load(), f"paged_decode_{build.DTYPES[q.dtype]}")(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), plan.tables.data_ptr(), plan.tables.stride(0),
        plan.context_lens.data_ptr(), plan.q_rows.data_ptr(), rows, plan.rows.data_ptr(), rows, q.shape[0],
        out.data_ptr(), hq, hkv, d, bs, scale, window, softcap, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the C decode refused the step's plan (code {rc})")


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C decode kernel takes these tensors (else: the torch twin)."""
    _, hq, d = q.shape
    _, bs, hkv, cache_d = k_cache.shape
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype in build.DTYPES
            and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and v_cache.shape == k_cache.shape
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and hkv > 0 and hq % hkv == 0 and hq // hkv <= MAX_GROUP
            and 0 < d <= MAX_HEAD_DIM and cache_d == d and 0 < bs <= MAX_BLOCK)


def paged_decode(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    seq_ids: torch.Tensor,  # [Bd] int32: the decode sequences (one query token each)
    out: torch.Tensor,  # [T, Hq, D]: the rows of those tokens are written
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Attention of the decode tokens of ``seq_ids``, within ``window`` and soft-capped by ``softcap``
    as paged_attention's; the caller has checked that every block id their windows cover lies in the
    pool (paged_attention does, once a step): the kernel trusts them.
    Errors are raised, not asserted, so that ``python -O`` keeps them: this reads raw memory."""
    lib = build.load()
    if lib is None:
        raise RuntimeError("the C decode attention is not built: check build.load() first")
    if not supports(q, k_cache, v_cache):
        raise ValueError(f"the C decode does not take q {q.dtype} {tuple(q.shape)} with caches "
                         f"{k_cache.dtype} {tuple(k_cache.shape)} (see supports())")
    for name, t, dtype in [("q", q, q.dtype), ("out", out, q.dtype), ("block_tables", block_tables, torch.int32),
                           ("cu_seqlens_q", cu_seqlens_q, torch.int32), ("context_lens", context_lens, torch.int32),
                           ("seq_ids", seq_ids, torch.int32)]:
        if not (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype}, strides {t.stride()}")
    num_seqs = context_lens.shape[0]
    if out.shape != q.shape or cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError("out must match q, and cu_seqlens_q, block_tables and context_lens cover the same sequences")
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    fn = getattr(lib, f"paged_decode_{build.DTYPES[q.dtype]}")
    # the kernel checks seq_ids and their query rows before it reads through them (a range check
    # here costs several torch ops on every layer)
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            context_lens.data_ptr(), cu_seqlens_q.data_ptr(), num_seqs, seq_ids.data_ptr(), seq_ids.numel(),
            q.shape[0], out.data_ptr(), hq, hkv, d, bs, scale, window, softcap, torch.get_num_threads())
    if rc == 2:
        raise ValueError(f"seq_ids must index the {num_seqs} sequences")
    if rc == 3:
        raise ValueError("a decode sequence's token lies outside q")
    if rc != 0:
        raise RuntimeError(f"the C decode refused Hq={hq} Hkv={hkv} D={d} block size {bs}")

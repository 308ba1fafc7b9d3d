"""Pure-torch paged attention: the CPU path of the engine and the oracle of the Triton kernel.

Decode sequences (one query token) go through batched SDPAs over their block tables gathered at
once, one per bucket of similar context lengths, padded to the bucket's longest context and
masked; longer query runs (prefill, chunked prefill, prefill on a cached prefix) go through one
SDPA each with a bottom-right causal mask.
Masked slots are read and weighted by zero, so the unwritten tail slots of a sequence's last
block must hold finite numbers: allocate the caches zeroed (torch.zeros), not with torch.empty.
On a small CPU the gather's memory traffic costs as much as the matmuls: bench/kernels_cpu.py
measures the variants this file chose between.
"""

import torch
import torch.nn.functional as F


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    # cache [num_blocks, bs, Hkv, D], tables [B, nb] -> [B, Hkv, num_tokens, D] (a strided view)
    num_seqs, num_tables = tables.shape
    bs, hkv, d = cache.shape[1:]
    # padding (-1) reads the sequence's own first block, never another's, which may hold NaN garbage
    flat = torch.where(tables >= 0, tables, tables[:, :1]).reshape(-1).long()
    # index_select on a 2-D view copies whole rows; on the 4-D cache it is ~5x slower on CPU
    kv = cache.view(cache.shape[0], -1).index_select(0, flat).view(num_seqs, num_tables * bs, hkv, d)
    return kv[:, :num_tokens].transpose(1, 2)


# a decode bucket costs about this many padded key slots (one sequence, one position) in fixed
# overhead on CPU: split a bucket where the slots saved outnumber it
BUCKET_COST_SLOTS = 1024


def _decode_padded(q, k_cache, v_cache, tables, context_lens, max_len, scale):
    # q [B, Hq, D]; one query token per sequence, at the last position of its context
    num_seqs, hq, d = q.shape
    bs = k_cache.shape[1]
    tables = tables[:, : (max_len + bs - 1) // bs]
    k = _gather_blocks(k_cache, tables, max_len)  # [B, Hkv, L, D]
    v = _gather_blocks(v_cache, tables, max_len)
    pos = torch.arange(max_len, device=q.device)
    valid = (pos[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid, scale=scale, enable_gqa=True)
    return out.view(num_seqs, hq, d)  # [B, Hq, D]


def _bucket_bounds(sorted_lens: list[int]) -> list[int]:
    """Start indices (and the end) of buckets of descending context lengths; every bucket is padded
    to its first (longest) member, and a new one starts where that saves more than it costs."""
    bounds = [0]
    for rank, n in enumerate(sorted_lens[1:], start=1):
        saved = (sorted_lens[bounds[-1]] - n) * (len(sorted_lens) - rank)  # if it and all after split off
        if saved > BUCKET_COST_SLOTS:
            bounds.append(rank)
    return bounds + [len(sorted_lens)]


def _decode(q, k_cache, v_cache, tables, context_lens, scale):
    # padding every sequence to the step's longest context would gather and attend over up to
    # 10x the keys when contexts differ; buckets of similar length keep the waste bounded
    lens = context_lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    sorted_lens = [lens[i] for i in order]
    bounds = _bucket_bounds(sorted_lens)
    if len(bounds) == 2:
        return _decode_padded(q, k_cache, v_cache, tables, context_lens, sorted_lens[0], scale)
    perm = torch.tensor(order, device=q.device)
    q, tables, context_lens = q[perm], tables[perm], context_lens[perm]  # longest context first
    parts = [_decode_padded(q[a:b], k_cache, v_cache, tables[a:b], context_lens[a:b], sorted_lens[a], scale)
             for a, b in zip(bounds[:-1], bounds[1:])]
    out = torch.empty_like(q)  # [B, Hq, D]
    out[perm] = torch.cat(parts)
    return out


def _prefill_one(q, k_cache, v_cache, table, context_len, scale):
    # q [n, Hq, D]: the last n positions of a context of context_len tokens
    n = q.shape[0]
    bs = k_cache.shape[1]
    table = table[None, : (context_len + bs - 1) // bs]
    k = _gather_blocks(k_cache, table, context_len)  # [1, Hkv, ctx, D]
    v = _gather_blocks(v_cache, table, context_len)
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    if n == context_len:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(context_len - n, context_len, device=q.device)
        allowed = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, ctx]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, Hq, D]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, pad -1
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32, KV length including this step's tokens
    scale: float,
    **hints,
) -> torch.Tensor:
    """See docs/CONTRACTS.md. hints (max_seqlen_q, max_context_len, num_splits) are the Triton
    launcher's and are accepted here so that the engine calls both alike."""
    assert q.shape[1] % k_cache.shape[2] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}"
    starts = cu_seqlens_q.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:], strict=True)]
    out = torch.empty_like(q)  # [T, Hq, D]
    if not q_lens or q.shape[0] == 0:
        return out
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if len(decode) == len(q_lens):
        return _decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    if decode:
        rows = torch.tensor(decode, device=q.device)
        tokens = torch.tensor([starts[b] for b in decode], device=q.device)
        out[tokens] = _decode(q[tokens], k_cache, v_cache, block_tables[rows], context_lens[rows], scale)
    ctx = context_lens.tolist()
    for b, n in enumerate(q_lens):
        if n > 1:
            s = starts[b]
            out[s : s + n] = _prefill_one(q[s : s + n], k_cache, v_cache, block_tables[b], ctx[b], scale)
    return out

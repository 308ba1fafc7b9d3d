"""Pure-torch paged attention: the CPU fallback of the engine and the oracle of the Triton and C kernels.

Decode sequences (one query token) go through batched SDPAs over their block tables gathered at
once, one per bucket of similar context lengths, padded to the bucket's longest context and
masked; longer query runs (prefill, chunked prefill, prefill on a cached prefix) go through one
SDPA each with a bottom-right causal mask.
Masked slots are read and weighted by zero, so the unwritten tail slots of a sequence's last
block must hold finite numbers: allocate the caches zeroed (torch.zeros), not with torch.empty.
On a small CPU the gather's memory traffic costs as much as the matmuls: bench/kernels_cpu.py
measures the variants this file chose between.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _gather_index(tables: torch.Tensor) -> torch.Tensor:
    # padding (-1) reads the sequence's own first block, never another's, which may hold NaN garbage
    return torch.where(tables >= 0, tables, tables[:, :1]).reshape(-1).long()  # [B * nb]


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, num_tokens: int,
                   flat: torch.Tensor | None = None) -> torch.Tensor:
    # cache [num_blocks, bs, Hkv, D], tables [B, nb] -> [B, Hkv, num_tokens, D] (a strided view)
    num_seqs, num_tables = tables.shape
    bs, hkv, d = cache.shape[1:]
    flat = _gather_index(tables) if flat is None else flat
    # index_select on a 2-D view copies whole rows; on the 4-D cache it is ~5x slower on CPU
    kv = cache.view(cache.shape[0], -1).index_select(0, flat).view(num_seqs, num_tables * bs, hkv, d)
    return kv[:, :num_tokens].transpose(1, 2)


# a decode bucket costs about this many padded key slots (one sequence, one position) in fixed
# overhead on CPU: split a bucket where the slots saved outnumber it
BUCKET_COST_SLOTS = 1024


def _bucket_bounds(sorted_lens: list[int]) -> list[int]:
    """Start indices (and the end) of buckets of descending context lengths; every bucket is padded
    to its first (longest) member, and a new one starts where that saves more than it costs."""
    bounds = [0]
    for rank, n in enumerate(sorted_lens[1:], start=1):
        saved = (sorted_lens[bounds[-1]] - n) * (len(sorted_lens) - rank)  # if it and all after split off
        if saved > BUCKET_COST_SLOTS:
            bounds.append(rank)
    return bounds + [len(sorted_lens)]


@dataclass
class _Bucket:
    rows: slice  # of the plan's decode tokens
    tables: torch.Tensor  # [b, nb] int32, trimmed to the bucket's longest context
    flat: torch.Tensor  # [b * nb] int64, blocks to gather
    max_len: int
    bias: torch.Tensor  # [b, 1, 1, L] 0 / -inf in q's dtype: what SDPA makes of a bool mask


@dataclass
class _Plan:
    """What every layer of a step derives alike from the step's metadata tensors."""

    key: tuple  # the metadata tensors themselves (held, so their ids stay theirs) and q's dtype
    num_tokens: int
    decode_tokens: torch.Tensor | None  # [Bd] token of each decode sequence, longest context first
    buckets: list[_Bucket]
    prefills: list[tuple[int, int, int, int]]  # (sequence, first token, tokens, context length)


_last_plan: _Plan | None = None


@dataclass
class StepLayout:
    """How a step's tokens divide into sequences, read once from its metadata tensors."""

    starts: list[int]  # cu_seqlens_q: first token of each sequence, then the token count
    context_lens: list[int]
    decode: list[int]  # sequences with one query token
    prefills: list[tuple[int, int, int, int]]  # (sequence, first token, tokens, context length)


def step_layout(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> StepLayout:
    starts, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:], strict=True)]
    if starts[0] != 0 or min(q_lens) < 0:
        raise ValueError("cu_seqlens_q must start at 0 and never decrease")
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    prefills = [(b, starts[b], n, ctx[b]) for b, n in enumerate(q_lens) if n > 1]
    return StepLayout(starts, ctx, decode, prefills)


def _make_plan(key, q_dtype, block_tables, cu_seqlens_q, context_lens, block_size) -> _Plan:
    layout = step_layout(cu_seqlens_q, context_lens)
    starts, ctx, prefills = layout.starts, layout.context_lens, layout.prefills
    decode = sorted(layout.decode, key=ctx.__getitem__, reverse=True)
    device = block_tables.device
    buckets, tokens = [], None
    if decode:
        tokens = torch.tensor([starts[b] for b in decode], device=device)
        rows = torch.tensor(decode, device=device)
        tables, lens = block_tables[rows], context_lens[rows]  # longest context first
        sorted_lens = [ctx[b] for b in decode]
        bounds = _bucket_bounds(sorted_lens)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            max_len = sorted_lens[a]
            t = tables[a:b, : (max_len + block_size - 1) // block_size]
            valid = torch.arange(max_len, device=device)[None, :] < lens[a:b, None]  # [b, L]
            bias = torch.zeros(valid.shape, dtype=q_dtype, device=device).masked_fill_(~valid, float("-inf"))
            buckets.append(_Bucket(slice(a, b), t, _gather_index(t), max_len, bias[:, None, None, :]))
    return _Plan(key, starts[-1], tokens, buckets, prefills)


def _plan(q, block_tables, cu_seqlens_q, context_lens, block_size) -> _Plan:
    # the layers of a step pass the same metadata tensors: plan once, on the first layer
    global _last_plan
    plan = _last_plan
    key = (block_tables, cu_seqlens_q, context_lens, q.dtype, block_size)
    if plan is None or len(plan.key) != len(key) or any(a is not b for a, b in zip(plan.key, key, strict=True)):
        plan = _last_plan = _make_plan(key, q.dtype, block_tables, cu_seqlens_q, context_lens, block_size)
    return plan


def _decode_bucket(q, k_cache, v_cache, bucket: _Bucket, scale):
    # q [b, Hq, D]; one query token per sequence, at the last position of its context
    k = _gather_blocks(k_cache, bucket.tables, bucket.max_len, bucket.flat)  # [b, Hkv, L, D]
    v = _gather_blocks(v_cache, bucket.tables, bucket.max_len, bucket.flat)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=bucket.bias, scale=scale,
                                         enable_gqa=True)
    return out.view(q.shape)  # [b, Hq, D]


def _decode(q, k_cache, v_cache, plan: _Plan, scale):
    # padding every sequence to the step's longest context would gather and attend over up to
    # 10x the keys when contexts differ; buckets of similar length keep the waste bounded
    qd = q.index_select(0, plan.decode_tokens)  # [Bd, Hq, D], longest context first
    parts = [_decode_bucket(qd[b.rows], k_cache, v_cache, b, scale) for b in plan.buckets]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def prefill_attention(
    q: torch.Tensor,  # [n, Hq, D]: the last n positions of a context of context_len tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks] int32: the sequence's block table
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's query run over its paged context, through one SDPA -> [n, Hq, D]."""
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
    launcher's and are accepted here so that the engine calls both alike.

    The metadata tensors must not be changed in place between calls: what is derived from them
    is kept for the next call that passes the same tensor objects (the next layer of the step)."""
    assert q.shape[1] % k_cache.shape[2] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}"
    out = torch.empty_like(q)  # [T, Hq, D]
    if q.shape[0] == 0 or cu_seqlens_q.shape[0] < 2:
        return out
    plan = _plan(q, block_tables, cu_seqlens_q, context_lens, k_cache.shape[1])
    assert plan.num_tokens == q.shape[0], f"cu_seqlens_q ends at {plan.num_tokens}, q has {q.shape[0]} tokens"
    if plan.buckets:
        out[plan.decode_tokens] = _decode(q, k_cache, v_cache, plan, scale)
    for b, s, n, ctx in plan.prefills:
        out[s : s + n] = prefill_attention(q[s : s + n], k_cache, v_cache, block_tables[b], ctx, scale)
    return out


def invariant_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, pad -1
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32, KV length including this step's tokens
    scale: float,
    **hints,
) -> torch.Tensor:
    """paged_attention computed the same way for every query token, whatever step it is in: its
    causal context walked block by block in order, in fp32, with one online softmax; decode,
    prefill, chunked prefill and cached prefixes alike, so a token's output depends only on its
    query and its keys and values (batch invariance). Each reduction is over one block's keys or
    one head's columns, whose order torch keeps whatever the number of tokens (checked by the
    kernel tests). Slower than paged_attention: the fallback where the C kernel does not apply."""
    assert q.shape[1] % k_cache.shape[2] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}"
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0 or cu_seqlens_q.shape[0] < 2:
        return torch.empty_like(q)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // hkv
    layout = step_layout(cu_seqlens_q, context_lens)
    assert layout.starts[-1] == num_tokens, f"cu_seqlens_q ends at {layout.starts[-1]}, q has {num_tokens} tokens"
    seqs, lens = [], []  # each token's sequence and causal context length
    for b, (start, end) in enumerate(zip(layout.starts[:-1], layout.starts[1:], strict=True)):
        first = layout.context_lens[b] - (end - start) + 1
        seqs.extend([b] * (end - start))
        lens.extend(range(first, first + end - start))
    device = q.device
    seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
    token_lens = torch.tensor(lens, dtype=torch.long, device=device)  # [T]
    tables = block_tables.long()[seq_index]  # [T, max_blocks]
    qf = q.float().view(num_tokens, hkv, group, 1, head_dim)
    best = torch.full((num_tokens, hkv, group), float("-inf"), device=device)
    total = torch.zeros(num_tokens, hkv, group, device=device)
    acc = torch.zeros(num_tokens, hkv, group, head_dim, device=device)
    offsets = torch.arange(bs, device=device)
    for j in range((max(lens) + bs - 1) // bs):
        rows = (token_lens > j * bs).nonzero().squeeze(1)  # tokens whose context reaches block j
        blocks = tables[rows, j]
        k = k_cache[blocks].float().permute(0, 2, 1, 3)[:, :, None]  # [A, Hkv, 1, bs, D]
        v = v_cache[blocks].float().permute(0, 2, 1, 3)[:, :, None]
        s = (qf[rows] * k).sum(-1) * scale  # [A, Hkv, G, bs]
        visible = (j * bs + offsets)[None, :] < token_lens[rows, None]  # [A, bs]
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        new_best = torch.maximum(best[rows], s.amax(-1))  # finite: every block a token reaches has a visible key
        p = torch.exp(s - new_best[..., None])
        alpha = torch.exp(best[rows] - new_best)
        total[rows] = total[rows] * alpha + p.sum(-1)
        acc[rows] = acc[rows] * alpha[..., None] + (p[..., None] * v).sum(-2)
        best[rows] = new_best
    return (acc / total[..., None]).view(num_tokens, num_heads, head_dim).to(q.dtype)

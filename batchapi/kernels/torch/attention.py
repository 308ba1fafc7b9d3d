"""Pure-torch paged attention: the CPU fallback of the engine and the oracle of the Triton and C kernels.

Decode sequences (one query token) go through batched SDPAs over their block tables gathered at
once, one per bucket of similar context lengths, padded to the bucket's longest context and
masked; longer query runs (prefill, chunked prefill, prefill on a cached prefix) go through one
SDPA each with a bottom-right causal mask.
Masked slots are read and weighted by zero, so the unwritten tail slots of a sequence's last
block must hold finite numbers: allocate the caches zeroed (torch.zeros), not with torch.empty.
A sliding window gathers from the block of the window's first key on (those before it may be
freed: they are never read); a soft cap, which SDPA cannot apply, computes the scores explicitly.
On a small CPU the gather's memory traffic costs as much as the matmuls: bench/kernels_cpu.py
measures the variants this file chose between.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def first_key(position: int, window: int) -> int:
    """The first key a query token at ``position`` sees: transformers' sliding window (key visible
    iff position - window < key <= position); window 0 is the whole causal context."""
    return max(0, position - window + 1) if window > 0 else 0


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, num_tokens: int,
                   flat: torch.Tensor | None = None) -> torch.Tensor:
    # cache [num_blocks, bs, Hkv, D], tables [B, nb] of block ids (no padding) -> [B, Hkv, num_tokens, D]
    # (a strided view)
    num_seqs, num_tables = tables.shape
    bs, hkv, d = cache.shape[1:]
    flat = tables.reshape(-1).long() if flat is None else flat
    # index_select on a 2-D view copies whole rows; on the 4-D cache it is ~5x slower on CPU
    kv = cache.view(cache.shape[0], -1).index_select(0, flat).view(num_seqs, num_tables * bs, hkv, d)
    return kv[:, :num_tokens].transpose(1, 2)


# a decode bucket costs about this many padded key slots (one sequence, one position) in fixed
# overhead on CPU: split a bucket where the slots saved outnumber it
BUCKET_COST_SLOTS = 1024


def _bucket_bounds(sorted_lens: list[int]) -> list[int]:
    """Start indices (and the end) of buckets of descending lengths (the key slots each sequence
    gathers); every bucket is padded to its first (longest) member, and a new one starts where that
    saves more than it costs."""
    bounds = [0]
    for rank, n in enumerate(sorted_lens[1:], start=1):
        saved = (sorted_lens[bounds[-1]] - n) * (len(sorted_lens) - rank)  # if it and all after split off
        if saved > BUCKET_COST_SLOTS:
            bounds.append(rank)
    return bounds + [len(sorted_lens)]


@dataclass
class _Bucket:
    rows: slice  # of the plan's decode tokens
    tables: torch.Tensor  # [b, nb] int64: the blocks each sequence gathers, from its window's first
    flat: torch.Tensor  # [b * nb] int64, the same flat
    max_len: int  # key slots gathered: the bucket's longest span
    visible: torch.Tensor  # [b, 1, 1, L] bool: the slots inside each sequence's window
    bias: torch.Tensor  # [b, 1, 1, L] 0 / -inf in q's dtype: what SDPA makes of the bool mask


@dataclass
class _Plan:
    """What every layer of a step derives alike from the step's metadata tensors."""

    key: tuple  # the metadata tensors themselves (held, so their ids stay theirs), q's dtype, the window
    num_tokens: int
    decode_tokens: torch.Tensor | None  # [Bd] token of each decode sequence, longest span first
    buckets: list[_Bucket]
    prefills: list[tuple[int, int, int, int]]  # (sequence, first token, tokens, context length)


_last_plans: dict[int, _Plan] = {}  # by window: the layers of a step may alternate windowed and global ones


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


def _make_plan(key, q_dtype, block_tables, cu_seqlens_q, context_lens, block_size, window) -> _Plan:
    layout = step_layout(cu_seqlens_q, context_lens)
    starts, ctx = layout.starts, layout.context_lens
    # a decode token gathers `span` key slots, from the block of its window's first key on
    first = {b: first_key(ctx[b] - 1, window) for b in layout.decode}
    span = {b: ctx[b] - first[b] // block_size * block_size for b in layout.decode}
    decode = sorted(layout.decode, key=span.__getitem__, reverse=True)
    if not decode:
        return _Plan(key, starts[-1], None, [], layout.prefills)
    device = block_tables.device
    rows = torch.tensor(decode, device=device)
    tables = block_tables[rows].long()  # longest span first
    firsts = torch.tensor([first[b] for b in decode], device=device)
    owned = (context_lens[rows].long() + block_size - 1) // block_size  # blocks each sequence holds
    spans = [span[b] for b in decode]
    bounds = _bucket_bounds(spans)
    buckets = [_make_bucket(slice(a, b), tables[a:b], firsts[a:b], owned[a:b], spans[a:b], block_size, q_dtype)
               for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return _Plan(key, starts[-1], torch.tensor([starts[b] for b in decode], device=device), buckets, layout.prefills)


def _make_bucket(rows: slice, tables, firsts, owned, spans: list[int], block_size: int, q_dtype) -> _Bucket:
    """The bucket of decode sequences ``rows``: tables [b, max_blocks], firsts [b] their windows' first
    keys, owned [b] the blocks they hold, spans their key slots from the first key's block, longest first."""
    device = tables.device
    max_len = spans[0]
    column = firsts[:, None] // block_size + torch.arange((max_len + block_size - 1) // block_size, device=device)
    ids = tables.gather(1, column.clamp(max=tables.shape[1] - 1))  # [b, nb]
    # past a shorter span: its first gathered block again, inside its window (never a freed one)
    ids = torch.where(column < owned[:, None], ids, ids[:, :1])
    slot = torch.arange(max_len, device=device)[None, :]
    lens = torch.tensor(spans, device=device)[:, None]
    visible = (slot >= firsts[:, None] % block_size) & (slot < lens)  # [b, L]
    bias = torch.zeros(visible.shape, dtype=q_dtype, device=device).masked_fill_(~visible, float("-inf"))
    return _Bucket(rows, ids, ids.reshape(-1), max_len, visible[:, None, None, :], bias[:, None, None, :])


def _plan(q, block_tables, cu_seqlens_q, context_lens, block_size, window) -> _Plan:
    # the layers of a step pass the same metadata tensors: plan once per window, on its first layer
    global _last_plans
    key = (block_tables, cu_seqlens_q, context_lens, q.dtype, block_size, window)

    def current(plan: _Plan) -> bool:
        return all(a is b for a, b in zip(plan.key[:-1], key[:-1], strict=True))

    plan = _last_plans.get(window)
    if plan is None or not current(plan):
        _last_plans = {w: p for w, p in _last_plans.items() if current(p)}  # other steps' go
        plan = _last_plans[window] = _make_plan(key, q.dtype, block_tables, cu_seqlens_q, context_lens,
                                                block_size, window)
    return plan


# query rows whose soft-capped scores are held at once: [Hq, rows, keys] in fp32
CAPPED_ROWS = 256


def _capped_attention(q, k, v, visible, scale: float, softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's soft-capped scores, softcap * tanh(s / softcap), which SDPA cannot
    apply: the scores in fp32, capped, masked, softmax.
    q [B, Hq, n, D], k and v [B, Hkv, L, D], visible bool [B or 1, 1, n, L] -> [B, Hq, n, D]"""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    kt, vf = k.float().transpose(-1, -2), v.float()  # [B, Hkv, D, L], [B, Hkv, L, D]
    out = torch.empty_like(q)
    for r in range(0, n, CAPPED_ROWS):
        rows = min(CAPPED_ROWS, n - r)
        # a KV head's query heads stacked as rows: one matmul a KV head, no broadcast copy of k
        qg = q[:, :, r : r + rows].float().reshape(b, hkv, -1, d)  # [B, Hkv, G * rows, D]
        s = torch.tanh(qg @ kt * scale / softcap) * softcap  # [B, Hkv, G * rows, L]
        s = s.view(b, hkv, -1, rows, s.shape[-1]).masked_fill(~visible[:, :, None, r : r + rows], float("-inf"))
        p = s.softmax(-1).view(b, hkv, -1, s.shape[-1])
        out[:, :, r : r + rows] = (p @ vf).view(b, hq, rows, d).to(q.dtype)
    return out


def _decode_bucket(q, k_cache, v_cache, bucket: _Bucket, scale, softcap):
    # q [b, Hq, D]; one query token per sequence, at the last position of its context
    k = _gather_blocks(k_cache, bucket.tables, bucket.max_len, bucket.flat)  # [b, Hkv, L, D]
    v = _gather_blocks(v_cache, bucket.tables, bucket.max_len, bucket.flat)
    if softcap > 0:
        out = _capped_attention(q[:, :, None, :], k, v, bucket.visible, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=bucket.bias, scale=scale,
                                             enable_gqa=True)
    return out.view(q.shape)  # [b, Hq, D]


def _decode(q, k_cache, v_cache, plan: _Plan, scale, softcap):
    # padding every sequence to the step's longest context would gather and attend over up to
    # 10x the keys when contexts differ; buckets of similar length keep the waste bounded
    qd = q.index_select(0, plan.decode_tokens)  # [Bd, Hq, D], longest span first
    parts = [_decode_bucket(qd[b.rows], k_cache, v_cache, b, scale, softcap) for b in plan.buckets]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def prefill_attention(
    q: torch.Tensor,  # [n, Hq, D]: the last n positions of a context of context_len tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks] int32: the sequence's block table
    context_len: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of one sequence's query run over its paged context (within ``window``,
    soft-capped by ``softcap`` as paged_attention's), through one SDPA -> [n, Hq, D]."""
    n = q.shape[0]
    bs = k_cache.shape[1]
    lo = first_key(context_len - n, window) // bs  # the block of the run's first token's first key
    table = table[None, lo : (context_len + bs - 1) // bs]
    k = _gather_blocks(k_cache, table, context_len - lo * bs)  # [1, Hkv, L, D]: keys lo * bs ..
    v = _gather_blocks(v_cache, table, context_len - lo * bs)
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    if n == context_len and not window and not softcap:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(context_len - n, context_len, device=q.device)[:, None]
        k_pos = torch.arange(lo * bs, context_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos  # [n, L]
        if window:
            allowed &= k_pos > q_pos - window
        if softcap:
            out = _capped_attention(qh, k, v, allowed[None, None], scale, softcap)
        else:
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
    *,
    window: int = 0,
    softcap: float = 0.0,
    **hints,
) -> torch.Tensor:
    """See docs/CONTRACTS.md. window > 0: a query token at position p sees the keys p - window + 1
    .. p only, and the blocks before its sequence's first query token's window are never read
    (they may be freed). softcap > 0: each scaled score s becomes softcap * tanh(s / softcap).
    hints (max_seqlen_q, max_context_len, num_splits) are the Triton launcher's and are accepted
    here so that the engine calls both alike.

    The metadata tensors must not be changed in place between calls: what is derived from them
    is kept for the next call that passes the same tensor objects (the next layer of the step)."""
    assert q.shape[1] % k_cache.shape[2] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}"
    assert window >= 0 and softcap >= 0, f"window {window} and softcap {softcap} must be >= 0 (0: none)"
    out = torch.empty_like(q)  # [T, Hq, D]
    if q.shape[0] == 0 or cu_seqlens_q.shape[0] < 2:
        return out
    plan = _plan(q, block_tables, cu_seqlens_q, context_lens, k_cache.shape[1], window)
    assert plan.num_tokens == q.shape[0], f"cu_seqlens_q ends at {plan.num_tokens}, q has {q.shape[0]} tokens"
    if plan.buckets:
        out[plan.decode_tokens] = _decode(q, k_cache, v_cache, plan, scale, softcap)
    for b, s, n, ctx in plan.prefills:
        out[s : s + n] = prefill_attention(q[s : s + n], k_cache, v_cache, block_tables[b], ctx, scale,
                                           window=window, softcap=softcap)
    return out


def invariant_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, pad -1
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32, KV length including this step's tokens
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    **hints,
) -> torch.Tensor:
    """paged_attention computed the same way for every query token, whatever step it is in: its
    causal context (its window's keys) walked block by block in order from the block of its first
    key, in fp32, with one online softmax; decode,
    prefill, chunked prefill and cached prefixes alike, so a token's output depends only on its
    query and its keys and values (batch invariance). Each reduction is over one block's keys or
    one head's columns, whose order torch keeps whatever the number of tokens (checked by the
    kernel tests). Slower than paged_attention: the fallback where the C kernel does not apply."""
    assert q.shape[1] % k_cache.shape[2] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}"
    assert window >= 0 and softcap >= 0, f"window {window} and softcap {softcap} must be >= 0 (0: none)"
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0 or cu_seqlens_q.shape[0] < 2:
        return torch.empty_like(q)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // hkv
    layout = step_layout(cu_seqlens_q, context_lens)
    assert layout.starts[-1] == num_tokens, f"cu_seqlens_q ends at {layout.starts[-1]}, q has {num_tokens} tokens"
    seqs, lens, firsts = [], [], []  # each token's sequence, causal context length and first key
    for b, (start, end) in enumerate(zip(layout.starts[:-1], layout.starts[1:], strict=True)):
        first = layout.context_lens[b] - (end - start) + 1
        seqs.extend([b] * (end - start))
        lens.extend(range(first, first + end - start))
        firsts.extend(first_key(p, window) for p in range(first - 1, first - 1 + end - start))
    device = q.device
    seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
    token_lens = torch.tensor(lens, dtype=torch.long, device=device)  # [T]
    token_firsts = torch.tensor(firsts, dtype=torch.long, device=device)  # [T]
    first_blocks = token_firsts // bs
    tables = block_tables.long()[seq_index]  # [T, max_blocks]
    qf = q.float().view(num_tokens, hkv, group, 1, head_dim)
    best = torch.full((num_tokens, hkv, group), float("-inf"), device=device)
    total = torch.zeros(num_tokens, hkv, group, device=device)
    acc = torch.zeros(num_tokens, hkv, group, head_dim, device=device)
    offsets = torch.arange(bs, device=device)
    for j in range(min(firsts) // bs, (max(lens) + bs - 1) // bs):
        # tokens whose window reaches block j: never one before its first key's block (maybe freed)
        rows = ((token_lens > j * bs) & (first_blocks <= j)).nonzero().squeeze(1)
        blocks = tables[rows, j]
        k = k_cache[blocks].float().permute(0, 2, 1, 3)[:, :, None]  # [A, Hkv, 1, bs, D]
        v = v_cache[blocks].float().permute(0, 2, 1, 3)[:, :, None]
        s = (qf[rows] * k).sum(-1) * scale  # [A, Hkv, G, bs]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        position = (j * bs + offsets)[None, :]
        visible = (position < token_lens[rows, None]) & (position >= token_firsts[rows, None])  # [A, bs]
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        new_best = torch.maximum(best[rows], s.amax(-1))  # finite: every block a token reaches has a visible key
        p = torch.exp(s - new_best[..., None])
        alpha = torch.exp(best[rows] - new_best)
        total[rows] = total[rows] * alpha + p.sum(-1)
        acc[rows] = acc[rows] * alpha[..., None] + (p[..., None] * v).sum(-2)
        best[rows] = new_best
    return (acc / total[..., None]).view(num_tokens, num_heads, head_dim).to(q.dtype)

"""Builders of paged-KV test cases and a plain dense causal attention to check them against."""

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, pad -1
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [ctx, Hkv, D]
    values: list[torch.Tensor]
    scale: float
    window: int = 0  # attention window of the case (0: whole context)

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.context_lens)


def make_case(
    q_lens: list[int],
    ctx_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_blocks: int | None = None,
    device: str = "cpu",
    window: int = 0,
    freed: str = "",
) -> PagedCase:
    """Sequences with the given query and context lengths; blocks placed at random permuted ids.

    Blocks no sequence owns hold NaN, so reading one shows in the output. num_blocks far larger
    than needed spreads the ids over a wide range; such a cache is left torch.empty (untouched
    pages cost no memory).

    window > 0 with freed "-1" or "nan": the blocks that lie wholly before the window of a
    sequence's first query token are released as the block manager releases them, their table
    entries -1 or left pointing at a block that now holds NaN (reused by another sequence): a
    kernel that reads them shows it. The case's keys and values stay whole (dense_attention
    masks by the window).
    """
    assert all(0 < q <= c for q, c in zip(q_lens, ctx_lens, strict=True)), "need 0 < q_len <= ctx_len"
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(c + block_size - 1) // block_size for c in ctx_lens]
    needed = sum(blocks_per_seq)
    num_blocks = num_blocks or needed + 5
    ids = _spread_ids(needed, num_blocks, g)
    k_cache = _poisoned_cache(num_blocks, block_size, hkv, d, dtype, device)
    v_cache = _poisoned_cache(num_blocks, block_size, hkv, d, dtype, device)
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    keys, values, pos = [], [], 0
    for b, (c, nb) in enumerate(zip(ctx_lens, blocks_per_seq, strict=True)):
        tables[b, :nb] = ids[pos : pos + nb]
        pos += nb
        k = torch.randn(nb * block_size, hkv, d, generator=g).to(dtype)
        v = torch.randn(nb * block_size, hkv, d, generator=g).to(dtype)
        blocks = tables[b, :nb].long().to(device)
        k_cache[blocks] = k.view(nb, block_size, hkv, d).to(device)
        v_cache[blocks] = v.view(nb, block_size, hkv, d).to(device)
        keys.append(k[:c].to(device))
        values.append(v[:c].to(device))
    if window and freed:
        assert freed in ("-1", "nan"), f"freed must be '-1' or 'nan', got {freed!r}"
        for b, (n, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            gone = max(0, c - n - window + 1) // block_size  # blocks before the first query's window
            for j in range(gone):
                if freed == "nan":
                    k_cache[int(tables[b, j])] = float("nan")
                    v_cache[int(tables[b, j])] = float("nan")
                else:
                    tables[b, j] = -1
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype).to(device)
    cu = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32, device=device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return PagedCase(q, k_cache, v_cache, tables.to(device), cu, ctx, keys, values, d**-0.5, window)


def _poisoned_cache(num_blocks, block_size, hkv, d, dtype, device) -> torch.Tensor:
    cache = torch.empty(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    if num_blocks <= 100_000:
        cache.fill_(float("nan"))  # blocks of no sequence: neither kernel nor twin may read them
    return cache


def _spread_ids(needed: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    if num_blocks <= 4 * needed:
        return torch.randperm(num_blocks, generator=g)[:needed].int()
    # sparse pick over a huge range: half from the top end, where offsets overflow int32
    top = num_blocks - 1 - torch.randperm(needed * 2, generator=g)[: needed // 2]
    rest = torch.randperm(num_blocks // 2, generator=g)[: needed - len(top)]
    ids = torch.cat([top, rest])
    return ids[torch.randperm(needed, generator=g)].int()


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def dense_attention(case: PagedCase, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention per sequence on contiguous K/V, in fp32, with an explicit softmax; within the
    case's window (a token at position p sees keys p - window + 1 .. p, as transformers' sliding
    window), scores soft-capped as Gemma 2's (softcap * tanh(s / softcap)) where softcap > 0."""
    outs = []
    starts = case.cu_seqlens_q.tolist()
    for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.q[starts[b] : starts[b + 1]].float()  # [n, Hq, D]
        n, hq, _ = q.shape
        ctx = k.shape[0]
        group = hq // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vf = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,chd->hnc", q, kf) * case.scale  # [Hq, n, ctx]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kv_pos = torch.arange(ctx, device=q.device)[None, :]
        hidden = kv_pos > q_pos
        if case.window:
            hidden |= kv_pos <= q_pos - case.window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hnc,chd->nhd", scores.softmax(-1), vf))
    return torch.cat(outs).to(case.q.dtype)

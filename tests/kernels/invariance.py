"""Batch-invariance checks shared by the kernel tests: an op's result for one token must not depend
on how many rows its call has, where the token sits among them, or how its sequence was split
into steps (decode, prefill, chunked prefill, a cached prefix)."""

from __future__ import annotations

import torch

from tests.kernels.paged import make_case


def check_attention(attention, dtype: torch.dtype, hq: int = 6, hkv: int = 2, d: int = 64, block_size: int = 16,
                    context: int = 70, seed: int = 0, window: int = 0, softcap: float = 0.0) -> None:
    """``attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=,
    softcap=)`` gives each query token of one sequence the same bits in a whole prefill, in chunks of
    any size, as a decode token, and beside other sequences before and after it. With a window, the
    other sequences' blocks before their runs' windows are freed (NaN)."""
    assert context >= 20, "the other sequences' runs are fixed, the probe's context must be at least 20"
    case = make_case([context, 5, 1, 20], [context, 40, 33, 20], hq, hkv, d, block_size, dtype, seed=seed,
                     window=window, freed="nan" if window else "")
    if softcap:
        case.q.mul_(10.0)  # scores out where the cap bends them
    q, k_cache, v_cache, tables = case.q, case.k_cache, case.v_cache, case.block_tables
    i32 = dict(dtype=torch.int32)

    def call(rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """rows: (sequence, first position, tokens) runs of query tokens of the case -> their outputs."""
        query = torch.cat([q_of(b, first, n) for b, first, n in rows])
        cu = torch.tensor([0] + torch.tensor([n for _, _, n in rows]).cumsum(0).tolist(), **i32)
        lens = torch.tensor([first + n for _, first, n in rows], **i32)
        return attention(query, k_cache, v_cache, tables[[b for b, _, _ in rows]].contiguous(), cu, lens, case.scale,
                         window=window, softcap=softcap)

    starts = case.cu_seqlens_q.tolist()
    ctx = case.context_lens.tolist()

    def q_of(b: int, first: int, n: int) -> torch.Tensor:
        # the case's queries are the last q_len positions of each context
        offset = first - (ctx[b] - (starts[b + 1] - starts[b]))
        return q[starts[b] + offset : starts[b] + offset + n]

    whole = call([(0, 0, context)])  # [context, Hq, D]: the prefill of the whole sequence
    assert torch.isfinite(whole.float()).all()
    for chunk in (1, 7, 16, 33):  # chunked prefill; chunk 1 is decode token by token
        parts = [call([(0, lo, min(chunk, context - lo))]) for lo in range(0, context, chunk)]
        assert torch.equal(torch.cat(parts), whole), f"chunks of {chunk}"
    # beside other sequences' tokens, before and after: decode rows, a prefill, a cached-prefix run
    mixed = call([(2, 32, 1), (1, 35, 5), (0, 0, context), (3, 0, 20)])
    assert torch.equal(mixed[6 : 6 + context], whole)
    cached = 2 * context // 3
    mixed = call([(0, cached, context - cached), (2, 32, 1), (3, 0, 20)])  # a run on a cached prefix
    assert torch.equal(mixed[: context - cached], whole[cached:])
    decode_rows = call([(1, 39, 1)] * 3 + [(0, context - 1, 1)] + [(2, 32, 1)] * 4)
    assert torch.equal(decode_rows[3], whole[-1])


def check_rows(op, *inputs: torch.Tensor) -> None:
    """A per-row op (norms, activations, argmax, rotary) of row-aligned ``inputs`` gives each row
    the same bits alone, in any row count and in any position."""
    def outputs(index) -> tuple:
        out = op(*(t[index].clone() for t in inputs))
        return out if isinstance(out, tuple) else (out,)

    rows = inputs[0].shape[0]
    full = outputs(slice(0, rows))
    for index in (slice(0, 1), slice(3, 4), slice(0, 7), slice(5, 38), slice(1, rows)):
        assert all(torch.equal(p, f[index]) for p, f in zip(outputs(index), full, strict=True)), index
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(m, f[order]) for m, f in zip(outputs(order), full, strict=True))

"""Pure-torch twin of the fused mixture-of-experts MLP: the CPU path and the test oracle.

A token's k routed slots are grouped by expert (a stable sort of the flattened ids), each active
expert runs one gate/up and one down projection over its gathered rows, and each slot's output,
scaled by its routing weight, goes back to the slot; a token's slots are then summed in slot order,
rounding as engine/model/moe.py's SparseMoE does.

Batch invariance: a BLAS picks its kernel by the row count (MKL's fp32 gives a row other bits at
1-3, 5-7 and 9-11 rows than at 4, 8 or 12+), so an expert's rows go through F.linear in blocks of
BLOCK_ROWS, zero-padded: every call has one shape, and a row's bits do not depend on how many rows
its expert got.
"""

import torch
import torch.nn.functional as F

from batchapi.kernels.torch.elementwise import silu_and_mul

BLOCK_ROWS = 16  # rows per matmul call: few enough that a decode step pads little


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> None:
    """The shapes and dtypes of fused_moe's arguments (docs/CONTRACTS.md, "Kernels")."""
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, (
        f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    experts, two_inter, hidden = w13.shape
    assert two_inter % 2 == 0 and x.shape[1] == hidden and tuple(w2.shape) == (experts, hidden, two_inter // 2), (
        f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not chain")
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and topk_ids.shape[1] >= 1, (
        f"topk_ids must be [T, k] with k >= 1, got {tuple(topk_ids.shape)} for x {tuple(x.shape)}")
    assert topk_weights.shape == topk_ids.shape, f"topk_weights {tuple(topk_weights.shape)}, ids {tuple(topk_ids.shape)}"
    assert topk_ids.dtype == torch.int64, f"topk_ids must be int64, got {topk_ids.dtype}"
    assert w13.dtype == w2.dtype == x.dtype, f"x is {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    assert topk_weights.dtype in (torch.float32, x.dtype), f"topk_weights must be fp32 or {x.dtype}, got {topk_weights.dtype}"


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32 or x.dtype
    topk_ids: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:
    """-> [T, H] in x.dtype: sum over slots s of topk_weights[t, s] * expert topk_ids[t, s] of x[t]."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()  # [T * k]: slot s of token t at t * k + s
    order = torch.argsort(flat, stable=True)  # the slots grouped by expert, in slot order within one
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # one read-back a call
    slots = x.new_empty(tokens * top_k, hidden)  # [T * k, H] each slot's expert output
    start = 0
    for expert, count in enumerate(counts):
        if count:
            picked = order[start : start + count]
            rows = x.index_select(0, picked // top_k)  # [count, H]
            slots[picked] = _linear(silu_and_mul(_linear(rows, w13[expert])), w2[expert])
            start += count
    scaled = (slots.view(tokens, top_k, hidden) * topk_weights[..., None]).to(x.dtype)  # [T, k, H]
    out = scaled[:, 0]
    for slot in range(1, top_k):  # in slot order: the same sum for a token in any batch
        out = out + scaled[:, slot]
    return out


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, (-rows) % BLOCK_ROWS))  # [ceil(rows / BLOCK_ROWS) * BLOCK_ROWS, K]
    blocks = [F.linear(padded[i : i + BLOCK_ROWS], weight) for i in range(0, padded.shape[0], BLOCK_ROWS)]
    return torch.cat(blocks)[:rows]

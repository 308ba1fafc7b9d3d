"""The grammar's token bitmask applied to logits in place: -inf on every token its row does not allow."""

import torch
import triton
import triton.language as tl

from batchapi.kernels.torch.bitmask import check_rows
from batchapi.kernels.triton.launch import check_last_dim_contiguous, check_launchable, check_same_device

BLOCK = 1024  # tokens (32 bitmask words) per program


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words, stride_l, BLOCK: tl.constexpr):
    k = tl.program_id(0)  # the k-th listed row, bitmask row k
    row = tl.load(rows_ptr + k).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = tokens < vocab
    word = tl.load(bitmask_ptr + k.to(tl.int64) * words + tokens // 32, mask=ok, other=-1)
    drop = ok & (((word >> (tokens % 32)) & 1) == 0)  # bit j of word w: token 32 w + j
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + tokens, minus_inf, mask=drop)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[rows[k], v] = -inf`` wherever bit v of ``bitmask[k]`` is 0 (the twin's
    contract, kernels.torch.bitmask). logits [B, V] float with a unit column stride; bitmask
    [len(rows), W] int32 contiguous, 32 W >= V, on the CPU (copied to logits' device) or there."""
    assert logits.dim() == 2 and bitmask.dim() == 2 and len(rows) == len(bitmask), (
        "one bitmask row per listed logits row"
    )
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous(), "bitmask must be contiguous int32"
    assert bitmask.shape[1] * 32 >= logits.shape[1], f"{bitmask.shape[1]} words cannot cover {logits.shape[1]} tokens"
    check_rows(rows, logits.shape[0])
    if not rows or not logits.shape[1]:
        return
    check_last_dim_contiguous(logits=logits)
    check_launchable(_apply_token_bitmask_kernel, logits)
    bitmask = bitmask.to(logits.device)
    at = torch.tensor(rows, dtype=torch.int64).to(logits.device)
    check_same_device(logits, bitmask, at)
    _apply_token_bitmask_kernel[(len(rows), triton.cdiv(logits.shape[1], BLOCK))](
        logits, bitmask, at, logits.shape[1], bitmask.shape[1], logits.stride(0), BLOCK=BLOCK,
    )

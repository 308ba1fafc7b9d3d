"""The pure-torch twin of apply_token_bitmask: the grammar's token bitmask applied to logits in place.

Bitmasks in the layout llguidance and xgrammar share: one row per constrained sequence of int32
words, bit j of word w allows token 32 * w + j (little-endian words; bits of tokens >= V unused).
"""

from __future__ import annotations

import functools
import sys

import torch


@functools.lru_cache(maxsize=16)
def _byte_bias(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, its 8 bits lowest first as -0.0 (allowed) or -inf.
    -0.0 because x + -0.0 is x bit for bit, negative zero included (x + 0.0 is not)."""
    bits = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    allowed = (torch.arange(256, dtype=torch.uint8)[:, None] & bits) != 0
    return torch.where(allowed, -0.0, float("-inf")).to(dtype=dtype, device=device)


def mask_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] additive bias: -0.0 where allowed, -inf elsewhere.

    A table lookup per byte: branch-free, so it costs the same for any mask (masked_fill_ with a
    bool mask is 3-4x slower, and slower still on masks that flip often)."""
    assert sys.byteorder == "little", "the byte view below assumes a little-endian host"
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous(), "bitmask must be contiguous int32"
    assert bitmask.shape[1] * 32 >= vocab_size, f"{bitmask.shape[1]} words cannot cover {vocab_size} tokens"
    # byte b of a row holds tokens 8b .. 8b+7, lowest bit first
    as_bytes = bitmask.view(torch.uint8).flatten().long()  # [R * 4W]
    bias = _byte_bias(dtype, bitmask.device).index_select(0, as_bytes)  # [R * 4W, 8]
    return bias.view(len(bitmask), -1)[:, :vocab_size]  # [R, V]


def check_rows(rows: list[int], batch: int) -> None:
    """IndexError, before anything is written, if a listed row lies outside logits' ``batch`` rows."""
    if rows and (min(rows) < 0 or max(rows) >= batch):
        bad = [r for r in rows if not 0 <= r < batch]
        raise IndexError(f"rows {bad[:8]} lie outside the logits' {batch} rows")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[rows[k], v] = -inf`` wherever bit v of ``bitmask[k]`` is 0; allowed
    logits and rows not listed keep their exact bits.

    logits [B, V] (any float dtype, values finite or -inf: a disallowed +inf or NaN becomes NaN
    here, -inf in the kernels), bitmask [len(rows), W] int32 contiguous with 32 W >= V (on any
    device: it is copied to logits'), rows host ints in [0, B) (else IndexError).
    """
    assert logits.dim() == 2 and len(rows) == len(bitmask), "one bitmask row per listed logits row"
    check_rows(rows, logits.shape[0])
    if not rows:
        return
    bias = mask_bias(bitmask.to(logits.device), logits.shape[1], logits.dtype)  # [R, V]
    logits.index_add_(0, torch.tensor(rows, dtype=torch.long, device=logits.device), bias)

"""The elementwise ops, the greedy argmax and the token bitmask in C (csrc/elementwise.c), same
contracts as their twins.

Each takes what C takes and hands the rest to its twin in kernels.torch.elementwise (the bitmask's
in kernels.torch.bitmask), as it does when the library did not build. They run ~15,000 times a
decode step of a 30-layer model, on small tensors: the checks are kept to cheap attribute reads (a
generator or torch.empty(size, dtype=...) costs microseconds here).
"""

from __future__ import annotations

import torch

from batchapi.kernels.cpu.build import DTYPES, load_elementwise
from batchapi.kernels.torch import bitmask as twin_bitmask
from batchapi.kernels.torch import elementwise as twin

MAX_ROTARY_DIM = 512  # as in csrc/elementwise.c

def _cpu_as(dtype: torch.dtype | None, *tensors: torch.Tensor) -> bool:
    """Whether all tensors are on the CPU, and of ``dtype`` unless it is None."""
    for t in tensors:
        if not t.is_cpu or (dtype is not None and t.dtype != dtype):
            return False
    return True


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t when each row t[i] is dense, whatever the step between rows (the engine's q, k and v are
    column slices of one qkv matrix: no copy); else a contiguous copy. C gets the row stride."""
    if t.is_contiguous():
        return t
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return t.contiguous()
        expected *= size
    return t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lib = load_elementwise()
    if (lib is None or x.dtype not in DTYPES or x.dim() != 2 or weight.shape != x.shape[1:]
            or not _cpu_as(x.dtype, x, weight)):
        return twin.rms_norm(x, weight, eps)
    x, weight = _dense_rows(x), weight.contiguous()
    n, h = x.shape
    out = torch.empty(n, h, dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), None, n, h, eps,
                 x.dtype is torch.bfloat16, torch.get_num_threads())
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = load_elementwise()
    if (lib is None or x.dtype not in DTYPES or x.dim() != 2 or residual.shape != x.shape
            or weight.shape != x.shape[1:] or not _cpu_as(x.dtype, x, residual, weight)):
        return twin.fused_add_rms_norm(x, residual, weight, eps)
    x, residual, weight = _dense_rows(x), _dense_rows(residual), weight.contiguous()
    n, h = x.shape
    out, summed = torch.empty(n, h, dtype=x.dtype), torch.empty(n, h, dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                 out.data_ptr(), summed.data_ptr(), n, h, eps, x.dtype is torch.bfloat16, torch.get_num_threads())
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = load_elementwise()
    if lib is None or x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] % 2 or not x.is_cpu:
        return twin.silu_and_mul(x)
    x = _dense_rows(x)
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, inter, dtype=x.dtype)
    lib.silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), n, inter, x.dtype is torch.bfloat16,
                     torch.get_num_threads())
    return out


def rotary(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    positions: torch.Tensor,  # [N] int64
    cos_sin: torch.Tensor,  # [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions outside cos_sin raise ValueError (the twin raises IndexError)."""
    lib = load_elementwise()
    if lib is None or q.dim() != 3 or k.dim() != 3 or cos_sin.dim() != 2 or positions.dim() != 1:
        return twin.rotary(q, k, positions, cos_sin)
    (n, hq, d), (k_rows, hkv, k_d), (max_pos, cs_d) = q.shape, k.shape, cos_sin.shape
    if not (q.dtype in DTYPES and k.dtype == q.dtype and cos_sin.dtype in DTYPES
            and positions.dtype in (torch.int32, torch.int64) and positions.shape[0] == k_rows == n
            and d == k_d == cs_d and d % 2 == 0 and d <= MAX_ROTARY_DIM and _cpu_as(None, q, k, positions, cos_sin)):
        return twin.rotary(q, k, positions, cos_sin)
    q, k, cos_sin = _dense_rows(q), _dense_rows(k), _dense_rows(cos_sin)
    if positions.dtype is not torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    q_out, k_out = torch.empty(n, hq, d, dtype=q.dtype), torch.empty(n, hkv, d, dtype=q.dtype)
    rc = lib.rotary(q.data_ptr(), q.stride(0), hq, q_out.data_ptr(), k.data_ptr(), k.stride(0), hkv, k_out.data_ptr(),
                    positions.data_ptr(), cos_sin.data_ptr(), cos_sin.stride(0), max_pos,
                    cos_sin.dtype is torch.bfloat16, n, d, q.dtype is torch.bfloat16, torch.get_num_threads())
    if rc == -2:
        raise RuntimeError(f"the C rotary refused head size {d}")
    if rc != 0:
        bad = positions[(positions < 0) | (positions >= max_pos)]
        raise ValueError(f"positions {bad[:8].tolist()} lie outside cos_sin's {max_pos} rows")
    return q_out, k_out


def rotary_store(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    positions: torch.Tensor,  # [N] int64
    cos_sin: torch.Tensor,  # [max_pos, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int, -1 = skip
) -> torch.Tensor:
    """rotary and store_kvcache in one pass (the rotated key goes straight to its slot): the
    rotated q. Raises what they raise, before anything is written."""
    lib = load_elementwise()
    if (lib is None or q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or cos_sin.dim() != 2
            or positions.dim() != 1 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape
            or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != k.shape[:1]
            or slot_mapping.dtype not in (torch.int32, torch.int64)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return twin.rotary_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    (n, hq, d), (k_rows, hkv, k_d), (max_pos, cs_d) = q.shape, k.shape, cos_sin.shape
    if not (q.dtype in DTYPES and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == q.dtype
            and cos_sin.dtype in DTYPES and positions.dtype in (torch.int32, torch.int64)
            and positions.shape[0] == k_rows == n and d == k_d == cs_d and d % 2 == 0 and d <= MAX_ROTARY_DIM
            and _cpu_as(None, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)):
        return twin.rotary_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    q, k, v, cos_sin = _dense_rows(q), _dense_rows(k), _dense_rows(v), _dense_rows(cos_sin)
    if positions.dtype is not torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    slot_mapping = slot_mapping.contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    q_out = torch.empty(n, hq, d, dtype=q.dtype)
    rc = lib.rotary_store(q.data_ptr(), q.stride(0), hq, q_out.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(),
                          v.stride(0), hkv, k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
                          slot_mapping.dtype is torch.int64, num_slots, positions.data_ptr(), cos_sin.data_ptr(),
                          cos_sin.stride(0), max_pos, cos_sin.dtype is torch.bfloat16, n, d, q.dtype is torch.bfloat16,
                          torch.get_num_threads())
    if rc == -2:
        raise RuntimeError(f"the C rotary refused head size {d}")
    if rc == -1:
        bad = positions[(positions < 0) | (positions >= max_pos)]
        raise ValueError(f"positions {bad[:8].tolist()} lie outside cos_sin's {max_pos} rows")
    if rc != 0:
        bad = slot_mapping[slot_mapping >= num_slots]
        raise ValueError(f"slots {bad[:8].tolist()} lie outside the KV caches' {num_slots} slots")
    return q_out


def store_kvcache(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int, -1 = skip
) -> None:
    """In place; a slot past the caches raises ValueError, before anything is written (the twin
    raises IndexError). Any dtype: the rows are copied as bytes when key and caches share it."""
    lib = load_elementwise()
    if (lib is None or key.dim() != 3 or k_cache.dim() != 4 or value.shape != key.shape
            or v_cache.shape != k_cache.shape or key.shape[1:] != k_cache.shape[2:]
            or slot_mapping.shape != key.shape[:1] or slot_mapping.dtype not in (torch.int32, torch.int64)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or not _cpu_as(key.dtype, key, value, k_cache, v_cache) or not slot_mapping.is_cpu):
        return twin.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    key, value, slot_mapping = _dense_rows(key), _dense_rows(value), slot_mapping.contiguous()
    (n, hkv, d), size = key.shape, key.element_size()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.store_kvcache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), slot_mapping.data_ptr(), slot_mapping.dtype is torch.int64, n,
                           num_slots, hkv * d * size, size)
    if rc != 0:
        bad = slot_mapping[slot_mapping >= num_slots]
        raise ValueError(f"slots {bad[:8].tolist()} lie outside the KV caches' {num_slots} slots")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of [B, V] logits (same index: the first of ties, the first NaN). In C for fp32 or
    bf16 CPU rows with a unit column stride: the row's largest value in vectors of its own dtype,
    then its first index from the vector of 16 that holds it, the rows shared by the threads (torch
    converts bf16 logits or scans them several times slower); the twin takes the rest."""
    lib = load_elementwise()
    if (lib is None or x.dim() != 2 or x.dtype not in DTYPES or not x.is_cpu or x.shape[0] == 0
            or x.shape[1] == 0 or x.stride(1) != 1):
        return twin.argmax(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.dtype is torch.bfloat16, out.data_ptr(),
                    torch.get_num_threads())
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[rows[k], v] = -inf`` wherever bit v of ``bitmask[k]`` is 0 (the twin's
    contract, kernels.torch.bitmask). In C for fp32 or bf16 CPU logits with a unit column stride and
    a CPU int32 contiguous bitmask: each word of all ones is skipped, the others' zero bits stored as
    -inf (one masked store per word with AVX-512); the twin takes the rest. A row outside the
    logits raises IndexError, before anything is written."""
    lib = load_elementwise()
    if (lib is None or logits.dim() != 2 or logits.dtype not in DTYPES or not logits.is_cpu
            or (logits.stride(1) != 1 and logits.shape[1] > 1) or bitmask.dim() != 2 or bitmask.dtype != torch.int32
            or not bitmask.is_cpu or not bitmask.is_contiguous() or len(bitmask) != len(rows)
            or bitmask.shape[1] * 32 < logits.shape[1]):
        return twin_bitmask.apply_token_bitmask(logits, bitmask, rows)
    if not rows:
        return
    at = torch.tensor(rows, dtype=torch.int64)
    rc = lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                 bitmask.data_ptr(), bitmask.shape[1], at.data_ptr(), len(rows),
                                 logits.dtype is torch.bfloat16, torch.get_num_threads())
    if rc != 0:
        twin_bitmask.check_rows(rows, logits.shape[0])  # raises IndexError, naming them
        raise IndexError(f"rows {rows[:8]} lie outside the logits' {logits.shape[0]} rows")

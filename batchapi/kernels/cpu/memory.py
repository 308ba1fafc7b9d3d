"""Memory for the CPU kernels' large operands (packed weights, the KV pool) in 2 MiB pages.

A decode step reads every weight once and each sequence's KV blocks, which lie anywhere in the pool:
on 4 KiB pages that is a TLB miss every 4 KiB of weights and nearly every KV block, each a walk of
the page tables. Linux backs anonymous memory with transparent huge pages where a region asks for
them (``madvise(MADV_HUGEPAGE)``; the common ``enabled`` setting is ``madvise``), and a 2 MiB page
covers 512 of the small ones. Measured on a 2-core Xeon with AMX (family 6 model 207): SmolLM2-135M's
decode-step AMX layers 1.00-1.03x as fast at 1-256 rows with their weights so (best of 20 rounds;
bench/kernels_cpu.py --op linear_bf16 prints both), its paged attention 1.04x (docs/BENCHMARKS.md).
numpy asks for huge pages for its own large arrays; torch, which allocates the packed weights, does
not.

The memory is an anonymous private mapping, zero until written and faulted in as touched, as
calloc's large blocks are; it starts on a 2 MiB boundary (so on a page, and on a cache line). Where
the OS has no such advice (not Linux, or a kernel without THP), the same mapping on small pages.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20


def zeroed_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes (uint8) starting on a 2 MiB boundary, in huge pages where the OS gives
    them; the array holds the mapping, which is unmapped when the last view of it goes."""
    length = nbytes + HUGE_PAGE
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages: small ones
            pass
    raw = np.frombuffer(region, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes]


def _tensor(raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(raw).view(dtype).view(shape)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in ``zeroed_pages``."""
    return _tensor(zeroed_pages(math.prod(shape) * dtype.itemsize), shape, dtype)


class Arena:
    """Tensors laid one after another in ``zeroed_pages`` regions of CHUNK bytes (a larger one gets a
    region of its own), so that a model's many small weights share huge pages rather than each
    holding one of its own; a region is unmapped when the last tensor in it goes."""

    CHUNK = 64 << 20
    ALIGN = 64  # each tensor starts on a cache line

    def __init__(self) -> None:
        self._region: np.ndarray | None = None
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor ``t`` in the arena."""
        nbytes = t.numel() * t.element_size()
        if nbytes > self.CHUNK:
            raw = zeroed_pages(nbytes)
        else:
            if self._region is None or self._used + nbytes > self.CHUNK:
                self._region, self._used = zeroed_pages(self.CHUNK), 0
            raw = self._region[self._used:self._used + nbytes]
            self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        out = _tensor(raw, tuple(t.shape), t.dtype)
        out.copy_(t)
        return out

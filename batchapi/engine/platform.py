"""CPU platform tuning the model runner applies: the allocator, and which dtype "auto" means here."""

from __future__ import annotations

import ctypes
import logging

import torch

from batchapi.engine.config import DTYPES
from batchapi.engine.model import onednn

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}  # config name -> torch dtype


def keep_freed_memory() -> None:
    """Stop glibc handing each step's large activations back to the OS and faulting them in again.

    By default a buffer over ~128 KiB is mmap-ed and unmapped on free, so every step page-faults
    its activations and gathered KV afresh; on a VM that doubled the decode step. Process-wide."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    libc.mallopt(m_trim_threshold, 1 << 30)


def resolve_device(device: str) -> str:
    """``auto``: cuda where torch sees a GPU, else cpu; any other name as it is."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, device: torch.device, hidden_size: int = 1024) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return fastest_cpu_dtype(hidden_size)


def fastest_cpu_dtype(hidden_size: int = 0) -> torch.dtype:
    """bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: oneDNN's packed bf16
    matmuls run 2-3x fp32 there), else float32 (AVX2 alone: bf16 falls back to loops about 6x
    slower than fp32; AVX-512 without BF16 emulates it).

    Decided by the instruction sets, never by timing: a choice by a race between the dtypes (as
    before) flipped with the machine's load, so two workers on one machine ran different dtypes
    and gave different answers to the same request (tests/workers/test_invariance_celery.py)."""
    native = onednn.bf16_native() and any(
        getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return torch.bfloat16 if native else torch.float32

"""CPU platform tuning the model runner applies: the allocator, and which dtype "auto" means here."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import torch

from batchapi.engine.config import DTYPES
from batchapi.engine.packed_linear import PackedLinear, can_pack

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


def resolve_dtype(name: str, device: torch.device, hidden_size: int = 1024) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return fastest_cpu_dtype(hidden_size)


_cpu_dtype_choice: dict[int, torch.dtype] = {}
_cpu_dtype_lock = threading.Lock()  # engines starting at once must not time each other's matmuls


def fastest_cpu_dtype(hidden_size: int) -> torch.dtype:
    """bfloat16 where this CPU's bf16 matmuls beat fp32 ones, else float32 (both are exact enough).

    Where oneDNN has no bf16 kernels for the CPU (AVX2 only) a bf16 matmul falls back to loops
    about 6x slower than fp32: float32, without measuring. Where it has them (AVX512-BF16, AMX)
    a packed bf16 matmul usually runs 2-3x fp32, but that is measured, not assumed."""
    with _cpu_dtype_lock:
        if hidden_size not in _cpu_dtype_choice:
            _cpu_dtype_choice[hidden_size] = _choose_cpu_dtype(hidden_size)
        return _cpu_dtype_choice[hidden_size]


def _choose_cpu_dtype(hidden_size: int) -> torch.dtype:
    if not _has_bf16_matmul_kernels():
        log.info("dtype auto on CPU: float32 (oneDNN has no bf16 matmul kernels for this CPU)")
        return torch.float32
    times = _race(hidden_size, (torch.float32, torch.bfloat16))
    choice = min(times, key=times.get)
    log.info("dtype auto on CPU: %s (linear [64, %d] x [%d, %d], best of 5: %s)", choice, hidden_size,
             hidden_size, 4 * hidden_size, ", ".join(f"{d}: {t * 1e3:.2f} ms" for d, t in times.items()))
    return choice


def _has_bf16_matmul_kernels() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_is_mkldnn_bf16_supported")
            and ops._is_mkldnn_bf16_supported())


def _race(hidden_size: int, dtypes: tuple[torch.dtype, ...], rows: int = 64, rounds: int = 5) -> dict:
    """Best time of the matmul a decode step is made of, run the way the engine would run it, per
    dtype; the dtypes take turns so that a burst of other load hits them alike."""
    runs = {}
    for dtype in dtypes:
        linear = torch.nn.Linear(hidden_size, 4 * hidden_size, bias=False).to(dtype).requires_grad_(False)
        if can_pack(linear):
            linear = PackedLinear.from_linear(linear, batch_hint=rows)
        runs[dtype] = (linear, torch.randn(rows, hidden_size, dtype=dtype))
    best = dict.fromkeys(dtypes, float("inf"))
    with torch.inference_mode():
        for linear, x in runs.values():
            linear(x)  # first call: oneDNN picks and caches its kernel
        for _ in range(rounds):
            for dtype, (linear, x) in runs.items():
                start = time.perf_counter()
                linear(x)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best

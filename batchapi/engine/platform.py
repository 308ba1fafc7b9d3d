"""CPU platform tuning the model runner applies: the allocator, the KV pool's pages, and which
dtype "auto" means here."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref

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


MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in writable, as a write would, changing no byte
PAGE = 4096


class PoolWarmer:
    """Faults in a CPU KV pool's pages ahead of the steps that would: in the order the block manager
    hands blocks out (block 0 first), a group of blocks at a time across every layer's K and V.

    The pool comes from calloc (model_runner.zeroed): nothing is faulted in at start, and each page a
    step first writes is faulted in by the KV store. On a VM that fault is dear (10-30 us a 4 KiB page
    here, the hypervisor's as much as the kernel's: a fresh 368 KiB block of SmolLM2's 30 layers about
    2 ms), so a run on a fresh pool spent a fifth of its time faulting. vLLM zeroes its pool before
    it serves; here ``start`` does that (run in the caller), and ``idle`` runs on a thread that the
    OS schedules only when a CPU has nothing else to run (SCHED_IDLE), so it never takes a core from
    a step, and a worker's pool is warm after its first idle seconds. That thread waits for the
    engine's first step to end (``go``), or a few seconds: beside the model's load and the first
    step its faults still cost the first token 0.3 s (bench/startup.py), though it ran on the idle core.
    ``madvise(MADV_POPULATE_WRITE)`` writes nothing: a block a step is filling meanwhile keeps every
    byte. Where the kernel lacks it (before 5.14) or is not Linux, nothing is faulted ahead."""

    GROUP = 32  # blocks a call: 192 KiB of one layer's K at SmolLM2's 6 KiB blocks, about half a ms
    WAIT = 5.0  # seconds an idle-class warmer waits for ``go`` before it starts anyway

    def __init__(self, tensors: list[torch.Tensor], num_blocks: int):
        self._tensors = [weakref.ref(t) for t in tensors]  # a closed engine's pool is freed, not kept
        self._spans = [(t.data_ptr(), t.nbytes // num_blocks) for t in tensors]  # (address, bytes a block)
        self.num_blocks = num_blocks
        self.warmed = 0  # blocks [0, warmed) are faulted in
        self._stop, self._go = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            self._libc = None

    def run(self) -> bool:
        """Fault every block in, in this thread; False where this system cannot (or it was stopped)."""
        for first in range(self.warmed, self.num_blocks, self.GROUP):
            last = min(first + self.GROUP, self.num_blocks)
            if self._stop.is_set() or not self._populate(first, last):
                return False
            self.warmed = last
        return True

    def start(self) -> PoolWarmer:
        """``run`` on a daemon thread at the idle scheduling class (only where the OS has it), once
        ``go`` is called or WAIT seconds have passed."""
        self._thread = threading.Thread(target=self._idle_run, name="kv-pool-warmer", daemon=True)
        self._thread.start()
        return self

    def go(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        if self._thread is not None:
            self._thread.join()

    def _idle_run(self) -> None:
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):  # no idle class: a warmer at normal priority would take a core
            return
        self._go.wait(self.WAIT)
        if not self.run() and not self._stop.is_set():
            log.info("KV pool: pages left to the steps (no MADV_POPULATE_WRITE here, or the pool is gone)")

    def _populate(self, first: int, last: int) -> bool:
        if self._libc is None:
            return False
        for ref, (address, per_block) in zip(self._tensors, self._spans, strict=True):
            tensor = ref()  # held for the call: the pool cannot be freed under it
            if tensor is None:
                return False
            start = (address + first * per_block) // PAGE * PAGE
            end = address + last * per_block
            if self._libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE) != 0:
                return False
        return True


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

"""CPU kernels in C (csrc/), compiled on first use with the machine's C compiler, called through ctypes.

The shared library is built once per source and CPU (-march=native) into the cache directory
(BATCHAPI_NATIVE_DIR, default ~/.cache/batchapi/native) and reused by every later process.
Without a compiler, or if the build fails, `load()` returns None and callers keep the pure-torch
twins: the native kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHAPI_NATIVE_DIR") or Path.home() / ".cache" / "batchapi" / "native")


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(compiler: str) -> Path:
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, " ".join(CFLAGS), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"paged_decode-{key}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile beside the target and rename: processes building at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None where it cannot be built."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
        return _state["lib"]


def _load() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, gcc or $CC): CPU decode attention stays on the torch twin")
        return None
    target = library_path(compiler)
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s failed, CPU decode attention stays on the torch twin: %s", SOURCE.name, detail)
        return None
    for suffix in DTYPES.values():
        fn = getattr(lib, f"paged_decode_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int] + (
            [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int])
    return lib


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native decode kernel takes these tensors (else: the torch twin)."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and k_cache.dtype == q.dtype
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[1] // k_cache.shape[2] <= 16
            and q.shape[2] <= 256)


def paged_decode(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    seq_ids: torch.Tensor,  # [Bd] int32: the decode sequences (one query token each)
    out: torch.Tensor,  # [T, Hq, D]: the rows of those tokens are written
    scale: float,
) -> None:
    lib = load()
    assert lib is not None, "native kernels are not built: check load() first"
    assert supports(q, k_cache), f"native decode takes fp32/bf16 CPU tensors, got {q.dtype} on {q.device}"
    for name, t, dtype in [("q", q, q.dtype), ("k_cache", k_cache, q.dtype), ("v_cache", v_cache, q.dtype),
                           ("out", out, q.dtype), ("block_tables", block_tables, torch.int32),
                           ("cu_seqlens_q", cu_seqlens_q, torch.int32), ("context_lens", context_lens, torch.int32),
                           ("seq_ids", seq_ids, torch.int32)]:
        assert t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu", (
            f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype}, strides {t.stride()}")
    assert out.shape == q.shape and v_cache.shape == k_cache.shape, "out must match q, v_cache k_cache"
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    fn = getattr(lib, f"paged_decode_{DTYPES[q.dtype]}")
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            context_lens.data_ptr(), cu_seqlens_q.data_ptr(), seq_ids.data_ptr(), seq_ids.numel(), out.data_ptr(),
            hq, hkv, d, bs, scale, torch.get_num_threads())
    assert rc == 0, f"native decode refused Hq={hq} Hkv={hkv} D={d}"

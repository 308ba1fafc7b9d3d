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
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 32  # as in csrc/paged_decode.c

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
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # mkstemp made it 0600: others sharing the directory must load it
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
    try:
        target = library_path(compiler)
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except Exception as exc:  # no home directory, a read-only cache, a failing compiler: the twin it is
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s failed, CPU decode attention stays on the torch twin: %s", SOURCE.name, detail)
        return None
    for suffix in DTYPES.values():
        fn = getattr(lib, f"paged_decode_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int] + (
            [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int])
    return lib


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native decode kernel takes these tensors (else: the torch twin)."""
    _, hq, d = q.shape
    _, bs, hkv, cache_d = k_cache.shape
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype in DTYPES
            and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and v_cache.shape == k_cache.shape
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and hkv > 0 and hq % hkv == 0 and hq // hkv <= MAX_GROUP
            and 0 < d <= MAX_HEAD_DIM and cache_d == d and 0 < bs <= MAX_BLOCK)


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
    """Attention of the decode tokens of ``seq_ids``; the caller has checked that every block id
    their contexts cover lies in the pool (attention_cpu does, once a step): the kernel trusts them.
    Errors are raised, not asserted, so that ``python -O`` keeps them: this reads raw memory."""
    lib = load()
    if lib is None:
        raise RuntimeError("native kernels are not built: check load() first")
    if not supports(q, k_cache, v_cache):
        raise ValueError(f"native decode does not take q {q.dtype} {tuple(q.shape)} with caches "
                         f"{k_cache.dtype} {tuple(k_cache.shape)} (see supports())")
    for name, t, dtype in [("q", q, q.dtype), ("out", out, q.dtype), ("block_tables", block_tables, torch.int32),
                           ("cu_seqlens_q", cu_seqlens_q, torch.int32), ("context_lens", context_lens, torch.int32),
                           ("seq_ids", seq_ids, torch.int32)]:
        if not (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype}, strides {t.stride()}")
    num_seqs = context_lens.shape[0]
    if out.shape != q.shape or cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError("out must match q, and cu_seqlens_q, block_tables and context_lens cover the same sequences")
    if seq_ids.numel() and not (0 <= int(seq_ids.min()) and int(seq_ids.max()) < num_seqs):
        raise ValueError(f"seq_ids must index the {num_seqs} sequences")
    rows = cu_seqlens_q.long()[seq_ids.long()]
    if seq_ids.numel() and not (0 <= int(rows.min()) and int(rows.max()) < q.shape[0]):
        raise ValueError("a decode sequence's token lies outside q")
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    fn = getattr(lib, f"paged_decode_{DTYPES[q.dtype]}")
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            context_lens.data_ptr(), cu_seqlens_q.data_ptr(), seq_ids.data_ptr(), seq_ids.numel(), out.data_ptr(),
            hq, hkv, d, bs, scale, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native decode refused Hq={hq} Hkv={hkv} D={d} block size {bs}")

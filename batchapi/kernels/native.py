"""CPU kernels in C (csrc/), compiled on first use with the machine's C compiler, called through ctypes.

Two libraries: paged_decode.c (decode attention, called by attention_cpu.py) and elementwise.c
(the norms, rotary, SiLU-and-mul and the KV store, whose launchers are here). Each is built once
per source and CPU (-march=native) into the cache directory (BATCHAPI_NATIVE_DIR, default
~/.cache/batchapi/native) and reused by every later process. Without a compiler, or if a build
fails, its loader returns None and callers keep the pure-torch twins: the native kernels are a
speed-up, never a requirement.
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

from batchapi.kernels import reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
ELEMENTWISE_SOURCE = SOURCE.with_name("elementwise.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 32  # as in csrc/paged_decode.c
MAX_ROTARY_DIM = 512  # as in csrc/elementwise.c

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


def library_path(compiler: str, source: Path = SOURCE) -> Path:
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, " ".join(CFLAGS), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def _build(compiler: str, target: Path, source: Path = SOURCE) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile beside the target and rename: processes building at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", tmp, str(source), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # mkstemp made it 0600: others sharing the directory must load it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(source: Path, stays: str) -> ctypes.CDLL | None:
    """The built library of ``source``, building it if needed; None (logged) where that fails."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, gcc or $CC): %s on the torch twin", stays)
        return None
    try:
        target = library_path(compiler, source)
        if not target.exists():
            _build(compiler, target, source)
        return ctypes.CDLL(str(target))
    except Exception as exc:  # no home directory, a read-only cache, a failing compiler: the twin it is
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s failed, %s on the torch twin: %s", source.name, stays, detail)
        return None


def load() -> ctypes.CDLL | None:
    """The decode attention library, building it on first use; None where it cannot be built."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
        return _state["lib"]


def load_elementwise() -> ctypes.CDLL | None:
    """The elementwise library, building it on first use; None where it cannot be built."""
    with _lock:
        if "elementwise" not in _state:
            _state["elementwise"] = _load_elementwise()
        return _state["elementwise"]


def _load() -> ctypes.CDLL | None:
    lib = _open(SOURCE, "CPU decode attention stays")
    if lib is None:
        return None
    for suffix in DTYPES.values():
        fn = getattr(lib, f"paged_decode_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
                       + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int] * 4
                       + [ctypes.c_float, ctypes.c_int])
    return lib


def _load_elementwise() -> ctypes.CDLL | None:
    lib = _open(ELEMENTWISE_SOURCE, "the CPU norms, rotary, SiLU and KV store stay")
    if lib is None:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {  # argument types, in csrc/elementwise.c's order
        "rms_norm": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32, i32],
        "silu_and_mul": [ptr, i64, ptr, i64, i64, i32, i32],
        "rotary": [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i32, i64, i64, i32, i32],
        "store_kvcache": [ptr, i64, ptr, i64, ptr, ptr, ptr, i32, i64, i64, i64, i64],
        "argmax_rows": [ptr, i64, i64, i64, i32, ptr],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


# ---- decode attention ----


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
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    fn = getattr(lib, f"paged_decode_{DTYPES[q.dtype]}")
    # the kernel checks seq_ids and their query rows before it reads through them (a range check
    # here costs several torch ops on every layer)
    rc = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            context_lens.data_ptr(), cu_seqlens_q.data_ptr(), num_seqs, seq_ids.data_ptr(), seq_ids.numel(),
            q.shape[0], out.data_ptr(), hq, hkv, d, bs, scale, torch.get_num_threads())
    if rc == 2:
        raise ValueError(f"seq_ids must index the {num_seqs} sequences")
    if rc == 3:
        raise ValueError("a decode sequence's token lies outside q")
    if rc != 0:
        raise RuntimeError(f"native decode refused Hq={hq} Hkv={hkv} D={d} block size {bs}")


# ---- elementwise ops: same contracts as their twins in reference.py, which take what C does not ----
# These run ~15,000 times a decode step of a 30-layer model, on small tensors: the checks are kept
# to cheap attribute reads (a generator or torch.empty(size, dtype=...) costs microseconds here).


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
        return reference.rms_norm(x, weight, eps)
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
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    x, residual, weight = _dense_rows(x), _dense_rows(residual), weight.contiguous()
    n, h = x.shape
    out, summed = torch.empty(n, h, dtype=x.dtype), torch.empty(n, h, dtype=x.dtype)
    lib.rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                 out.data_ptr(), summed.data_ptr(), n, h, eps, x.dtype is torch.bfloat16, torch.get_num_threads())
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = load_elementwise()
    if lib is None or x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] % 2 or not x.is_cpu:
        return reference.silu_and_mul(x)
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
        return reference.rotary(q, k, positions, cos_sin)
    (n, hq, d), (k_rows, hkv, k_d), (max_pos, cs_d) = q.shape, k.shape, cos_sin.shape
    if not (q.dtype in DTYPES and k.dtype == q.dtype and cos_sin.dtype in DTYPES
            and positions.dtype in (torch.int32, torch.int64) and positions.shape[0] == k_rows == n
            and d == k_d == cs_d and d % 2 == 0 and d <= MAX_ROTARY_DIM and _cpu_as(None, q, k, positions, cos_sin)):
        return reference.rotary(q, k, positions, cos_sin)
    q, k, cos_sin = _dense_rows(q), _dense_rows(k), _dense_rows(cos_sin)
    if positions.dtype is not torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    q_out, k_out = torch.empty(n, hq, d, dtype=q.dtype), torch.empty(n, hkv, d, dtype=q.dtype)
    rc = lib.rotary(q.data_ptr(), q.stride(0), hq, q_out.data_ptr(), k.data_ptr(), k.stride(0), hkv, k_out.data_ptr(),
                    positions.data_ptr(), cos_sin.data_ptr(), cos_sin.stride(0), max_pos,
                    cos_sin.dtype is torch.bfloat16, n, d, q.dtype is torch.bfloat16, torch.get_num_threads())
    if rc == -2:
        raise RuntimeError(f"native rotary refused head size {d}")
    if rc != 0:
        bad = positions[(positions < 0) | (positions >= max_pos)]
        raise ValueError(f"positions {bad[:8].tolist()} lie outside cos_sin's {max_pos} rows")
    return q_out, k_out


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
        return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    key, value, slot_mapping = _dense_rows(key), _dense_rows(value), slot_mapping.contiguous()
    (n, hkv, d), size = key.shape, key.element_size()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.store_kvcache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), slot_mapping.data_ptr(), slot_mapping.dtype is torch.int64, n,
                           num_slots, hkv * d * size, size)
    if rc != 0:
        bad = slot_mapping[slot_mapping >= num_slots]
        raise ValueError(f"slots {bad[:8].tolist()} lie outside the KV caches' {num_slots} slots")


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(-1) of a [B, V] fp32 or bf16 CPU tensor with dense rows (same index: the first of
    ties, the first NaN); None where C does not take x. One pass over the row in its own dtype,
    where torch converts bf16 logits or scans them several times slower."""
    lib = load_elementwise()
    if lib is None or x.dim() != 2 or x.dtype not in DTYPES or not x.is_cpu or x.shape[1] == 0 or x.stride(1) != 1:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.dtype is torch.bfloat16, out.data_ptr())
    return out

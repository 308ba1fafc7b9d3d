"""Build and load the C kernels (csrc/) with the machine's C compiler; they are called through ctypes.

Four libraries: paged_decode.c (decode attention, launched by attention.py), elementwise.c
(the norms, rotary, SiLU-and-mul, the KV store, the argmax and the token bitmask, launched by
elementwise.py), matmul.c (linear layers with bf16 weights: bf16-stored in fp32 arithmetic, and
bf16 on AVX512-BF16; launched by matmul.py) and decoder.c (a step's decoder layers by the other
three's entry points, launched by decoder.py). Each is built once per source and CPU (-march=native) into the cache directory
(BATCHAPI_NATIVE_DIR, default ~/.cache/batchapi/native) and reused by every later process. Without
a compiler, or if a build fails, its loader returns None and callers keep the pure-torch twins: the
native kernels are a speed-up, never a requirement.
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
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
ELEMENTWISE_SOURCE = SOURCE.with_name("elementwise.c")
MATMUL_SOURCE = SOURCE.with_name("matmul.c")
DECODER_SOURCE = SOURCE.with_name("decoder.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # what the kernels take, and their C suffixes

_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHAPI_NATIVE_DIR") or Path.home() / ".cache" / "batchapi" / "native")


def cpu_flags() -> str:
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
                                    cpu_flags()]).encode()).hexdigest()[:16]
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


def _once(name: str, loader: Callable[[], ctypes.CDLL | None]) -> ctypes.CDLL | None:
    """``loader()``'s library, built and loaded on the first call in this process (None: it cannot be)."""
    with _lock:
        if name not in _state:
            _state[name] = loader()
        return _state[name]


def load() -> ctypes.CDLL | None:
    """The decode attention library, building it on first use; None where it cannot be built."""
    return _once("lib", _load)


def load_elementwise() -> ctypes.CDLL | None:
    """The elementwise library, building it on first use; None where it cannot be built."""
    return _once("elementwise", _load_elementwise)


def load_matmul() -> ctypes.CDLL | None:
    """The bf16 linear layers' library, building it on first use; None where it cannot be built."""
    return _once("matmul", _load_matmul)


def load_decoder() -> ctypes.CDLL | None:
    """The decoder layers' library (one call for a step's layers), building it on first use; None where
    it cannot be built."""
    return _once("decoder", _load_decoder)


def _load_decoder() -> ctypes.CDLL | None:
    lib = _open(DECODER_SOURCE, "the model's layers stay a kernel call each from Python")
    if lib is not None:
        ptr = ctypes.c_void_p
        lib.decoder_layers.restype = ctypes.c_int
        lib.decoder_layers.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int]
    return lib


def _load_matmul() -> ctypes.CDLL | None:
    lib = _open(MATMUL_SOURCE, "bf16 weights are widened to float32 at load and the linear layers stay")
    if lib is not None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.linear_bf16w.restype = ctypes.c_int
        lib.linear_bf16w.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ctypes.c_int]
        lib.linear_bf16.restype = ctypes.c_int
        lib.linear_bf16.argtypes = lib.linear_bf16w.argtypes
        lib.linear_bf16_native.restype = ctypes.c_int
        lib.linear_bf16_instructions.restype = ctypes.c_int
        lib.linear_bf16_instructions.argtypes = [ctypes.c_int]
        for linear in (lib.linear_bf16_silu, lib.linear_amx, lib.linear_amx_silu):
            linear.restype = ctypes.c_int
            linear.argtypes = lib.linear_bf16w.argtypes
        for argmax in (lib.linear_bf16w_argmax, lib.linear_bf16_argmax, lib.linear_amx_argmax):
            argmax.restype = ctypes.c_int
            argmax.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ctypes.c_int]
        lib.linear_amx_native.restype = ctypes.c_int
        lib.linear_bf16_screen_native.restype = ctypes.c_int
        lib.linear_bf16_argmax_screened.restype = ctypes.c_int
        lib.linear_bf16_argmax_screened.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ctypes.c_float,
                                                    ptr, ptr, ctypes.c_int]
    return lib


def _load() -> ctypes.CDLL | None:
    lib = _open(SOURCE, "CPU decode attention stays")
    if lib is None:
        return None
    for suffix in DTYPES.values():
        fn = getattr(lib, f"paged_decode_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
                       + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int] * 4
                       + [ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int])  # scale window softcap threads
    lib.paged_check_tables.restype = ctypes.c_int
    lib.paged_check_tables.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    lib.paged_decode_amx.restype = ctypes.c_int  # 1: bf16 decode runs on AMX tiles (head sizes a multiple of 32)
    lib.paged_decode_amx.argtypes = []
    lib.paged_decode_set_amx.restype = None  # 0 keeps it on the vector units (tests and benches compare them)
    lib.paged_decode_set_amx.argtypes = [ctypes.c_int]
    return lib


def _load_elementwise() -> ctypes.CDLL | None:
    lib = _open(ELEMENTWISE_SOURCE, "the CPU norms, rotary, SiLU, KV store, argmax and token bitmask stay")
    if lib is None:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {  # argument types, in csrc/elementwise.c's order
        "rms_norm": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32, i32],
        "silu_and_mul": [ptr, i64, ptr, i64, i64, i32, i32],
        "rotary": [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i32, i64, i64, i32, i32],
        "store_kvcache": [ptr, i64, ptr, i64, ptr, ptr, ptr, i32, i64, i64, i64, i64],
        "rotary_store": [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i32, i64, ptr, ptr, i64, i64, i32,
                         i64, i64, i32, i32],
        "argmax_rows": [ptr, i64, i64, i64, i32, ptr, i32],
        "apply_token_bitmask": [ptr, i64, i64, i64, ptr, i64, ptr, i64, i32, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib

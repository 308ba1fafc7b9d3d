"""oneDNN's packed linear: the one door to torch's private ``torch.ops.mkldnn`` ops.

torch has no public API for a weight reordered once for oneDNN and multiplied many times:
``_reorder_linear_weight`` packs it and ``_linear_pointwise`` multiplies by it (linears.py says why
the engine wants that: 1.38x its tokens/s on an AVX2-only CPU, and a row's bits the same at every
row count, which batch invariance relies on).
Where a torch build lacks the ops, or they fail a one-time check against F.linear, ``available``
says no and the layers stay plain nn.Linear, that is F.linear; which of the two runs is logged once
per dtype. tests/engine/model/test_onednn.py fails when a torch upgrade changes the ops.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

OPS = ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
CHECK_ROWS = (1, 5, 33)  # the self-check's row counts: kernels switch at small counts
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # oneDNN's sums against MKL's, per dtype
NOT_NATIVE = "the CPU has no native bf16"  # no fault: dtype auto picks fp32 there


def pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """An opaque oneDNN copy of ``weight`` [out, in]; ``batch_hint`` picks its blocking, any row
    count may use it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the packed weight: [N, in] -> [N, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def bf16_native() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU (AVX512-BF16 or AMX), not by emulation."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_is_mkldnn_bf16_supported")
            and ops._is_mkldnn_bf16_supported())


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether linear layers in ``dtype`` run packed here; the answer is logged the first time."""
    reason = unavailable(dtype)
    if reason is None:
        log.info("%s linear layers on CPU: oneDNN's packed weights (torch %s)", dtype, torch.__version__)
    elif reason == NOT_NATIVE:
        log.info("%s linear layers on CPU: F.linear (%s)", dtype, reason)
    else:  # torch changed under the engine: it still runs, slower
        log.warning("%s linear layers on CPU: F.linear, not oneDNN's packed linear: %s", dtype, reason)
    return reason is None


def unavailable(dtype: torch.dtype) -> str | None:
    """Why the packed path cannot run ``dtype`` here, or None where it can."""
    if not torch.backends.mkldnn.is_available():
        return f"torch {torch.__version__} is built without oneDNN"
    missing = [name for name in OPS if not hasattr(torch.ops.mkldnn, name)]
    if missing:
        return f"torch {torch.__version__} has no torch.ops.mkldnn.{', '.join(missing)}"
    if dtype == torch.bfloat16 and not bf16_native():
        return NOT_NATIVE
    return mismatch(dtype)


@torch.inference_mode()
def mismatch(dtype: torch.dtype) -> str | None:
    """Packs a small random layer and compares its outputs with F.linear's: what differs, or None."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator).to(dtype)  # [out, in]
    bias = torch.randn(48, generator=generator).to(dtype)
    tol = TOLERANCE[dtype]
    try:
        packed = pack(weight, max(CHECK_ROWS))
        for rows in CHECK_ROWS:
            x = torch.randn(rows, 64, generator=generator).to(dtype)
            got, expected = linear(x, packed, bias), F.linear(x, weight, bias)
            if got.shape != expected.shape or not torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol):
                return f"torch {torch.__version__}: mkldnn._linear_pointwise differs from F.linear at {rows} rows"
    except (RuntimeError, TypeError, ValueError) as exc:  # a changed schema raises one of these
        return f"torch {torch.__version__}: torch.ops.mkldnn failed on a packed weight: {exc}"
    return None

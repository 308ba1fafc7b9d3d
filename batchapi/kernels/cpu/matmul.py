"""Linear layers with bf16 weights, in C (csrc/matmul.c): bf16-stored in fp32 arithmetic, and bf16
on AVX512-BF16.

**bf16-stored** (``pack``, ``linear``): where the CPU has no native bf16 matmuls the engine computes in float32, and a decode step, which
reads every weight once, is bound by the weights' bytes. A bf16 checkpoint's weights are exact in
bf16, so ``pack`` keeps them so (half the bytes of float32) and ``linear`` widens each weight as it
multiplies: the float32 layer's values, summed in one fixed order per output (csrc/matmul.c), so a
row gets the same bits at any row count and batch invariance needs no padding or blocks.

**bf16** (``pack_pairs``, ``linear_bf16``): where the CPU multiplies bf16 natively with AVX512-BF16,
bf16 activations by bf16 weights packed in pairs for VDPBF16PS, each output one chain over the pairs
in order (invariant as the above), rounded to bf16 as oneDNN's bf16 layers round. The same chains
run either as VDPBF16PS or as the two fused multiply-adds it does, in its order and rounding
(``bf16_instructions``): the same bits, chosen at load for speed, since some CPUs (a Xeon without
AMX) run VDPBF16PS at half their FMA rate.

**AMX** (``linear_amx``): the same packed weights as AMX tiles (a panel's 16 pairs are one B tile as
they lie), 32 rows by 2 panels a tile step, each output one chain of TDPBF16PS over K in order: one
call a step at AMX's rate and invariant as it is, where oneDNN's AMX kernel changes its sums between
row counts (batch invariance then ran its calls in 32-row pieces).

**Greedy argmax** (``linear_argmax``, ``linear_bf16_argmax``, ``linear_amx_argmax``): each kernel's outputs folded,
as each tile finishes, into each row's largest and its first column, never written: the index
torch's argmax gives on the outputs. A greedy step's lm_head, whose logits are the largest output
of the step (25 MB at 256 rows of SmolLM2 in bf16, 50 MB in float32), written only to be read back once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchapi.kernels.cpu.build import load_matmul

log = logging.getLogger(__name__)

PANEL = 16  # outputs a panel: as in csrc/matmul.c
INSTRUCTIONS = ("dpbf16", "fma")  # linear_bf16's two ways to the same bits, in the C library's numbering
INSTRUCTIONS_ENV = "BATCHAPI_BF16_INSTRUCTIONS"  # one of INSTRUCTIONS; unset or "auto": timed at load


_lib = None  # the loaded library, once: a step makes hundreds of calls


def _library():
    global _lib
    if _lib is None:
        lib = load_matmul()
        if lib is not None and lib.linear_bf16_native() == 1:
            _choose_instructions(lib)
        _lib = lib
    return _lib


def _choose_instructions(lib) -> None:
    """Set which instructions ``linear_bf16`` runs: the environment's choice, else the faster of the two
    on one thread (what each core does; a team of threads would time a busy machine's scheduler) on a
    layer of a decode step's shape, 32 rows by 576 -> 768, the best of five alternated calls each
    (about 10 ms once a process, at start-up, beside other work)."""
    wanted = os.environ.get(INSTRUCTIONS_ENV, "auto")
    if wanted in INSTRUCTIONS:
        lib.linear_bf16_instructions(INSTRUCTIONS.index(wanted))
        return
    if wanted != "auto":
        log.warning("%s=%r is none of auto, %s: timing them", INSTRUCTIONS_ENV, wanted, ", ".join(INSTRUCTIONS))
    rows, n, k = 32, 768, 576
    x = torch.ones(rows, k, dtype=torch.bfloat16)
    packed = torch.full((n // PANEL, k // 2, PANEL), 0x3F803F80, dtype=torch.int32)  # pairs of bf16 1.0
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    best = [float("inf")] * len(INSTRUCTIONS)
    refused = False  # a call refused (no memory for the widened rows): VDPBF16PS, which needs none
    for round_ in range(6):  # the first round a warm-up
        for choice in range(len(INSTRUCTIONS)):
            lib.linear_bf16_instructions(choice)
            start = time.perf_counter()
            rc = lib.linear_bf16(x.data_ptr(), k, rows, packed.data_ptr(), n, k, None, y.data_ptr(), n, 1)
            refused = refused or rc != 0
            if round_:
                best[choice] = min(best[choice], time.perf_counter() - start)
    faster = not refused and best[1] < 0.9 * best[0]  # FMAs only if clearly faster
    chosen = lib.linear_bf16_instructions(1 if faster else 0)
    log.info("bf16 linear layers on %s (a test layer %.3f ms with VDPBF16PS, %.3f ms with FMAs, one thread)",
             INSTRUCTIONS[chosen], best[0] * 1e3, best[1] * 1e3)


def bf16_instructions(name: str | None = None) -> str:
    """The instructions ``linear_bf16`` and ``linear_bf16_argmax`` run: "dpbf16" (VDPBF16PS) or "fma"
    (two VFMADD231PS a pair, in VDPBF16PS's order and rounding: the same bits). ``name`` sets it for the
    process (where the kernels run on AVX512-BF16). Chosen at load by ``BATCHAPI_BF16_INSTRUCTIONS``, or
    timed."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the bf16 linear kernels are not built here")
    if name is not None and name not in INSTRUCTIONS:
        raise ValueError(f"bf16 instructions are one of {INSTRUCTIONS}, not {name!r}")
    return INSTRUCTIONS[lib.linear_bf16_instructions(-1 if name is None else INSTRUCTIONS.index(name))]


def available() -> bool:
    return _library() is not None


def exact_in_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 ``weight`` survives bf16 (a bf16 checkpoint's do)."""
    return weight.dtype == torch.float32 and torch.equal(weight.to(torch.bfloat16).to(torch.float32), weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 or bf16 -> the layout csrc/matmul.c reads: [panels, in, 16] bf16, the 16
    columns of a panel in the order 0, 8, 1, 9, ..., 7, 15, the last panel padded with zeros."""
    out_features, in_features = weight.shape
    w = F.pad(weight.detach().to(torch.bfloat16), (0, 0, 0, (-out_features) % PANEL))  # [N', K]
    # [P, 2, 8, K] (panel, half, column in half, k) -> [P, K, 8, 2]: per k, column j then j + 8
    return w.view(-1, 2, PANEL // 2, in_features).permute(0, 3, 2, 1).contiguous().view(-1, in_features, PANEL)


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``pack``'s inverse, in float32: [out, in]."""
    panels, in_features, _ = packed.shape
    w = packed.view(panels, in_features, PANEL // 2, 2).permute(0, 3, 2, 1).reshape(-1, in_features)
    return w[:out_features].float()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 ``x`` [..., in] and ``packed = pack(weight)``."""
    lib, x2, rows, row_stride, bias = _stored_args("linear_bf16w", x, packed, out_features, bias)
    in_features = packed.shape[1]
    out = torch.empty(rows, out_features, dtype=torch.float32)
    rc = lib.linear_bf16w(x2.data_ptr(), row_stride, rows, packed.data_ptr(), out_features, in_features,
                          bias.data_ptr() if bias is not None else None, out.data_ptr(), out_features,
                          torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"linear_bf16w refused [{rows}, {in_features}] x [{out_features}, {in_features}]")
    return out.view(*x.shape[:-1], out_features)


def linear_argmax(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(...).argmax(-1)`` without the outputs written: [..., in] -> int64 [...], the index torch's
    argmax gives on ``linear``'s float32 outputs (the first of ties, the first NaN). A greedy step's
    lm_head where the engine computes in float32."""
    lib, x2, rows, row_stride, bias = _stored_args("linear_bf16w_argmax", x, packed, out_features, bias)
    in_features = packed.shape[1]
    chosen = torch.empty(rows, dtype=torch.int64)
    rc = lib.linear_bf16w_argmax(x2.data_ptr(), row_stride, rows, packed.data_ptr(), out_features, in_features,
                                 bias.data_ptr() if bias is not None else None, chosen.data_ptr(),
                                 torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"linear_bf16w_argmax refused [{rows}, {in_features}] x [{out_features}, {in_features}]")
    return chosen.view(x.shape[:-1])


def _stored_args(kernel: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None):
    """The library and the bf16-stored kernels' forms of x (rows, their stride) and of the bias, checked."""
    lib = _library()
    panels, in_features, panel = packed.shape
    if (lib is None or packed.dtype != torch.bfloat16 or not packed.is_contiguous() or panel != PANEL
            or panels * PANEL < out_features or x.shape[-1] != in_features
            or (bias is not None and bias.shape != (out_features,))):
        raise ValueError(f"{kernel} cannot multiply x {tuple(x.shape)} by a packed weight {tuple(packed.shape)} "
                         f"{packed.dtype} of {out_features} outputs (bias {None if bias is None else tuple(bias.shape)})")
    x2, rows, row_stride = _rows(x, in_features, torch.float32)
    if bias is not None:
        bias = bias.detach().float().contiguous()
    return lib, x2, rows, row_stride, bias


def _rows(x: torch.Tensor, in_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """``x`` [..., in] as [rows, in] in ``dtype`` with unit column stride: (it, rows, its row stride)."""
    x2 = x.reshape(-1, in_features)
    rows = x2.shape[0]
    if x2.stride(1) != 1 or x2.dtype != dtype:
        x2 = x2.contiguous().to(dtype)
    row_stride = x2.stride(0) if rows > 1 else in_features  # a single row's stride is anything: unused
    if row_stride < in_features:
        x2, row_stride = x2.contiguous(), in_features
    return x2, rows, row_stride


def _panel_form(bias: torch.Tensor, panels: int) -> bool:
    return bias.shape == (panels * PANEL,) and bias.dtype == torch.float32 and bias.is_contiguous()


def native_amx() -> bool:
    """Whether ``linear_amx`` runs here: the kernel built with AMX-BF16 and the OS grants the tiles."""
    lib = _library()
    return lib is not None and lib.linear_amx_native() == 1


def native_bf16() -> bool:
    """Whether ``linear_bf16`` runs on AVX512-BF16 here (else it runs the same operations in plain C:
    the same bits, far slower)."""
    lib = _library()
    return lib is not None and lib.linear_bf16_native() == 1


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the layout csrc/matmul.c's ``linear_bf16`` reads: [panels, ceil(in / 2), 16] int32,
    each the bf16 pair (w[n][2i], w[n][2i + 1]) in its low and high halves; zeros pad the last pair
    (odd ``in``) and the last panel."""
    out_features, in_features = weight.shape
    w = F.pad(weight.detach().to(torch.bfloat16), (0, in_features % 2, 0, (-out_features) % PANEL))  # [N', K']
    pairs = w.shape[1] // 2
    # [P, 16, pairs, 2] -> [P, pairs, 16, 2]: per pair, the panel's 16 columns, each its two values
    return w.view(-1, PANEL, pairs, 2).permute(0, 2, 1, 3).contiguous().view(torch.int32).view(-1, pairs, PANEL)


def unpack_pairs(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """``pack_pairs``'s inverse: [out, in] bf16."""
    panels, pairs, _ = packed.shape
    w = packed.contiguous().view(torch.bfloat16).view(panels, pairs, PANEL, 2).permute(0, 2, 1, 3)
    return w.reshape(panels * PANEL, pairs * 2)[:out_features, :in_features]


def panel_bias(bias: torch.Tensor, out_features: int) -> torch.Tensor:
    """A bias [out_features] as ``linear_bf16`` reads it: float32, zeros up to whole panels."""
    return F.pad(bias.detach().float(), (0, (-out_features) % PANEL)).contiguous()


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in bf16 for bf16 ``x`` [..., in] and ``packed = pack_pairs(weight)``
    of ``weight`` [out_features, in_features], the bias added in fp32 before the output is rounded.
    ``bias`` is [out_features], or ``panel_bias``'s form of it (a layer makes that once)."""
    return _pairs_call("linear_bf16", x, packed, out_features, in_features, bias)


def linear_amx(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_bf16`` on AMX tiles, the same arguments (``in_features`` a multiple of 32): each
    output one chain of tile dot products over K in order, so a row's bits do not depend on the
    call's other rows (they may differ from ``linear_bf16``'s). Only where ``native_amx()``."""
    if in_features % 32:
        raise ValueError(f"linear_amx needs in_features a multiple of 32, not {in_features}")
    return _pairs_call("linear_amx", x, packed, out_features, in_features, bias)


def linear_bf16_silu(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """An MLP's gate and up projections and its SiLU-and-mul in one call: for ``packed = pack_pairs(w)`` of
    ``w = [w_gate; w_up]`` [out_features, in_features] (``out_features`` a multiple of 32),
    ``silu_and_mul(linear_bf16(x, packed, ...))`` [..., out_features / 2], the same bits, without the
    projections' outputs written. Only where ``native_bf16()``."""
    return _silu_call("linear_bf16_silu", x, packed, out_features, in_features)


def linear_amx_silu(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """``linear_bf16_silu`` on AMX tiles (``in_features`` a multiple of 32): ``silu_and_mul(linear_amx(x,
    packed, ...))``, the same bits. Only where ``native_amx()``."""
    if in_features % 32:
        raise ValueError(f"linear_amx_silu needs in_features a multiple of 32, not {in_features}")
    return _silu_call("linear_amx_silu", x, packed, out_features, in_features)


def _silu_call(name: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    if out_features % (2 * PANEL):
        raise ValueError(f"{name} needs out_features a multiple of {2 * PANEL}, not {out_features}")
    lib, x2, rows, row_stride, _ = _pairs_args(name, x, packed, out_features, in_features, None)
    y = torch.empty(rows, out_features // 2, dtype=torch.bfloat16)
    rc = getattr(lib, name)(x2.data_ptr(), row_stride, rows, packed.data_ptr(), out_features, in_features, None,
                            y.data_ptr(), y.stride(0), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{name} refused [{rows}, {in_features}] x [{out_features}, {in_features}]")
    return y.view(*x.shape[:-1], out_features // 2)


def linear_bf16_argmax(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_bf16(...).argmax(-1)`` without the outputs written: [..., in] -> int64 [...], the index
    torch's argmax gives on ``linear_bf16``'s bf16 outputs (the first of ties, the first NaN). A greedy
    step's lm_head: its logits are never stored or read back."""
    return _pairs_argmax("linear_bf16_argmax", x, packed, out_features, in_features, bias)


def linear_amx_argmax(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_bf16_argmax`` of ``linear_amx``'s outputs (``in_features`` a multiple of 32)."""
    if in_features % 32:
        raise ValueError(f"linear_amx_argmax needs in_features a multiple of 32, not {in_features}")
    return _pairs_argmax("linear_amx_argmax", x, packed, out_features, in_features, bias)


def _pairs_argmax(kernel: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    lib, x2, rows, row_stride, bias = _pairs_args(kernel, x, packed, out_features, in_features, bias)
    chosen = torch.empty(rows, dtype=torch.int64)
    rc = getattr(lib, kernel)(x2.data_ptr(), row_stride, rows, packed.data_ptr(), out_features, in_features,
                              bias.data_ptr() if bias is not None else None, chosen.data_ptr(),
                              torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{kernel} refused [{rows}, {in_features}] x [{out_features}, {in_features}]")
    return chosen.view(x.shape[:-1])


@dataclass(frozen=True)
class Screen:
    """A weight's int8 form for ``linear_bf16_argmax_screened`` (``pack_screen``): its quads, per panel
    [in / 4, 16, 4] uint8 (q + 128, q = round(w / s) in [-127, 127]), and per column [4, panels * 16]
    float32: the scale s, the norms of w - s q, of s q and of w (each rounded up), and the largest of
    the last."""
    quads: torch.Tensor
    stats: torch.Tensor
    largest_norm: float


def screen_native() -> bool:
    """Whether ``linear_bf16_argmax_screened`` screens here (the kernel built with AVX512-BF16 and
    AVX512-VNNI); elsewhere it is ``linear_bf16_argmax``."""
    lib = _library()
    return lib is not None and lib.linear_bf16_screen_native() == 1


def pack_screen(weight: torch.Tensor, columns: int = 4096) -> Screen | None:
    """``weight`` [out, in] (bf16 values) in the form the screen reads, ``columns`` at a time; None where
    it cannot screen: ``in`` not a multiple of 4 of at least 32, a weight not finite, or a column's norm
    past float32."""
    out_features, in_features = weight.shape
    if in_features % 4 or in_features < 32:
        return None
    panels = (out_features + PANEL - 1) // PANEL
    quads = torch.full((panels * PANEL, in_features), 128, dtype=torch.uint8)
    stats = torch.zeros(4, panels * PANEL, dtype=torch.float32)
    up = 1 + 2**-20  # norms rounded up past float32's rounding of them
    for lo in range(0, out_features, columns):
        w = weight[lo:lo + columns].detach().to(torch.bfloat16).double()
        if not torch.isfinite(w).all():
            return None
        w = torch.where(w.abs() < torch.finfo(torch.float32).tiny, 0.0, w)  # denormals: as VDPBF16PS reads them
        scale = (w.abs().amax(1) / 127).float()  # as the kernel reads it
        s = scale.double()[:, None]
        q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
        rounded = s * q
        quads[lo:lo + len(w)] = (q + 128).to(torch.uint8)
        stats[:, lo:lo + len(w)] = torch.stack([scale.double(), (w - rounded).norm(dim=1) * up,
                                                rounded.norm(dim=1) * up, w.norm(dim=1) * up]).float()
    if not torch.isfinite(stats).all():  # a column's norm past float32
        return None
    # [P, 16, in / 4, 4] -> [P, in / 4, 16, 4]: per quad of K, the panel's 16 columns, each its four weights
    quads = quads.view(panels, PANEL, in_features // 4, 4).permute(0, 2, 1, 3).contiguous()
    return Screen(quads, stats, float(stats[3].max()))


def linear_bf16_argmax_screened(x: torch.Tensor, packed: torch.Tensor, screen: Screen, out_features: int,
                                in_features: int, bias: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """``linear_bf16_argmax``'s choices, the same index, from most outputs bounded in int8 and only the
    groups of columns that may hold a row's largest computed (csrc/matmul.c). Returns (them, how many
    of the rows' groups of 48 columns ran exactly)."""
    lib, x2, rows, row_stride, bias = _pairs_args("linear_bf16_argmax_screened", x, packed, out_features,
                                                  in_features, bias)
    if (packed.shape[0] != -(-out_features // PANEL) or screen.quads.shape != (packed.shape[0], in_features // 4, PANEL, 4)
            or screen.stats.shape != (4, packed.shape[0] * PANEL)):
        raise ValueError(f"a screen {tuple(screen.quads.shape)} is not of the packed weight {tuple(packed.shape)}")
    chosen = torch.empty(rows, dtype=torch.int64)
    exact = ctypes.c_int64(0)
    rc = lib.linear_bf16_argmax_screened(x2.data_ptr(), row_stride, rows, packed.data_ptr(), out_features,
                                         in_features, bias.data_ptr() if bias is not None else None,
                                         screen.quads.data_ptr(), screen.stats.data_ptr(), screen.largest_norm,
                                         chosen.data_ptr(), ctypes.byref(exact), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"linear_bf16_argmax_screened refused [{rows}, {in_features}] x [{out_features}, "
                           f"{in_features}]")
    return chosen.view(x.shape[:-1]), exact.value


def _pairs_args(kernel: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
                bias: torch.Tensor | None):
    """The library and the C kernel's forms of x (rows, their stride) and of the bias, checked."""
    lib = _library()
    panels, pairs, panel = packed.shape
    if (lib is None or packed.dtype != torch.int32 or not packed.is_contiguous() or panel != PANEL
            or panels * PANEL < out_features or pairs != (in_features + 1) // 2 or x.shape[-1] != in_features
            or x.dtype != torch.bfloat16
            or (bias is not None and bias.shape != (out_features,) and not _panel_form(bias, panels))):
        raise ValueError(f"{kernel} cannot multiply x {tuple(x.shape)} {x.dtype} by a packed weight "
                         f"{tuple(packed.shape)} {packed.dtype} of {out_features} outputs "
                         f"(bias {None if bias is None else tuple(bias.shape)})")
    x2, rows, row_stride = _rows(x, in_features, torch.bfloat16)
    if bias is not None and not _panel_form(bias, panels):  # read a whole panel at a time
        bias = panel_bias(bias, out_features)
    return lib, x2, rows, row_stride, bias


def _pairs_call(kernel: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    lib, x2, rows, row_stride, bias = _pairs_args(kernel, x, packed, out_features, in_features, bias)
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    rc = getattr(lib, kernel)(x2.data_ptr(), row_stride, rows, packed.data_ptr(), out_features, in_features,
                              bias.data_ptr() if bias is not None else None, out.data_ptr(), out_features,
                              torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"{kernel} refused [{rows}, {in_features}] x [{out_features}, {in_features}]")
    return out.view(*x.shape[:-1], out_features)

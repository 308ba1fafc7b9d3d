"""The model's linear layers on CPU and CUDA: oneDNN-packed weights, and batch invariance.

**Packing.** bf16 and fp32 linear layers on CPU with their weights reordered for oneDNN once, at load
(through onednn.py, which holds torch's private oneDNN ops and falls back to F.linear without them).

F.linear on a bf16 weight makes oneDNN reorder the weight into its blocked (AMX/AVX-512) layout
on every call, which at decode batch sizes costs about as much as the matmul itself: a step's
matmuls ran 1.5x faster with the weights packed beforehand. The packed matmul runs the same
kernel and gives bit-identical outputs (checked for bf16 at batch 1..4096). F.linear sends fp32 to
MKL instead; oneDNN's packed fp32 kernel is another one (its sums differ from MKL's in the last
bits) and, on a 2-core AVX2-only AMD EPYC, 1.2x MKL on the projections and 2.2-2.6x on the
lm_head at 8-128 rows, and the same bits for a row at every row count, where MKL's change
(so batch invariance pads nothing): vLLM's CPU build packs fp32 for oneDNN too.

**Batch invariance.** A matmul library picks its kernel and blocking by the shape, and a kernel
for some row counts may sum along K in another order than the one for others. Measured: on an
AVX512-BF16 CPU, fp32 through MKL gives other bits at 1-3, 5-7 and 9-11 rows than at 4, 8 and 12
or more, bf16 through oneDNN other bits at 1 row for some inputs. On an AMX Xeon (2 threads, torch
2.13) oneDNN's bf16 kernel sums as in the largest call at 1..32 rows and from about N rows on (576
to 1941 for SmolLM2's projections) but otherwise in between, in ranges with gaps and single counts
(576x960: 33..479, 609, 641..649, ..., 1159..1904; the test model's 512x192: 37..191 and 321..382);
its lm_head (576x49152, up to 256 rows) otherwise only at 1..32. Its fp32 kernel gives the same bits
at every count but 1 row of 1536x576. Each row of a matmul is otherwise independent of the rest:
within one kernel every row is reduced alike.

So each linear runs in one of three ways, by what ``invariant_row_counts`` finds at load on the
layer's own weights, comparing row counts against the most rows a step can hold (``probe_rows``):
``whole_from``, the smallest row count from which this CPU's kernel gives every row the same bits
at every larger count, and ``split_rows``, the most rows S (up to 32) such that every count 1..S
does too.

- Padded: where ``whole_from`` is at most ``BLOCK_ROWS``, a call of fewer rows is padded with zeros
  up to it. Padding costs only the smallest steps, whose matmuls read the weights anyway.
- Split: where every count 1..S agrees, a call of fewer than ``whole_from`` rows runs as calls of at
  most S rows, and a larger one as one call: both give the largest call's bits, unpadded. On the AMX
  CPU in bf16 SmolLM2's four projections run so at 4096 rows a step (S = 32; one call from 576,
  705, 1151 and 1919 rows on), and the test model's 512x192 at 300 (from 192).
- Blocks: otherwise the layer runs in fixed blocks of ``BLOCK_ROWS`` rows, each a call of one shape,
  which gives a row the same bits in any block and at any place in it. Where 1..S agree but no
  ``whole_from`` does, blocks, not S-row pieces: a step's matmuls here are bound by reading the
  weight once a call (a 32-row call took 0.65-0.75 of a 64-row one, one thread, SmolLM2's
  projections), so 32-row pieces cost 1.3-1.5x the blocks from 48 rows a step on and save 1.6-1.8x
  only at steps of up to 32 rows. (SmolLM2's lm_head at 256 rows pads to 33.)

The rows compared matter as much as the counts. A bf16 output is an fp32 sum rounded to 8 bits,
so another order of the sums shows only where it crosses a rounding boundary: on random rows in
about 1 output in 10^4, at some counts in no row at all (the first probe, on random rows, found
512x192 invariant from 1 row on the AMX CPU). ``probe_input`` makes rows nearly orthogonal to the
weight's rows, whose outputs are near-cancellations a few hundred times smaller than their terms:
there 1-3% of the outputs and nearly every row differ. The probe's results are cached per CPU,
torch, shape, dtype, threads and ``PROBE_VERSION``.

Fixed blocks for every layer would be exact on any library but cost 12-50% of a step on the
AVX512-BF16 CPU (bench in the note of issue 15); the probe keeps oneDNN's one call per step
where it can.

**bf16-stored weights.** Where the engine computes in float32 on CPU (no native bf16 matmuls) and
a layer's weight is exact in bf16 (a bf16 checkpoint's are), ``pack_linears`` makes it a
``Bf16StoredLinear``: the weight kept in bf16 and widened to float32 as the C kernel multiplies
(kernels/cpu/matmul.py), the same values in float32 arithmetic on half the bytes. A decode step
reads every weight once, so there the step is bound by those bytes: on a 2-core AVX2 EPYC the C
kernel ran Qwen3-0.6B's layers 1.65-2.0x as fast as oneDNN's packed fp32 at 1 row, 1.26-1.52x at
8-16 rows and as fast from 64 rows on (bench/kernels_cpu.py --op linear_bf16w). Its every output is one multiply-add chain in a fixed
order, so a row has the same bits at any row count: ``make_invariant`` leaves these layers as they are.

**bf16 on AVX512-BF16.** Where the engine computes in bf16 on a CPU with AVX512-BF16 and no AMX,
``pack_linears`` makes a bf16 layer an ``Avx512Bf16Linear``: its weight packed in pairs for VDPBF16PS
(kernels/cpu/matmul.py), each weight panel read from memory once a call and run against every row.
oneDNN's bf16 kernel read a decode step's weights at about half the memory's rate at 1 row and ran
48-96 rows at 270-340 GFLOP/s where cached weights ran at 380-430; the C kernel was 1.62x at 1 row,
1.25x at 48, 1.12x at 96 and 0.97x at 256 on a 2-core EPYC Zen 4 (bench/kernels_cpu.py --op
linear_bf16). One chain of VDPBF16PS per output, over the pairs in order: invariant as it is.

**bf16 on AMX.** With AMX the vector units run at a third of the tiles' rate, and oneDNN's AMX kernel
gives a row other bits at 33..575 rows than at 1..32 (above), so batch invariance ran its calls in
32-row pieces: 0.69x of not invariant on a 96-prompt run (Xeon, family 6 model 167). There
``pack_linears`` makes a bf16 layer whose K is whole 32-element chunks an ``AmxBf16Linear``: the
same pair-packed weight as AMX tiles (``linear_amx``), one chain of TDPBF16PS per output over K in
order, so one call a step and invariant as it is: against one call of oneDNN's (which invariance
could not make), 1.04x at 1 row, 1.15x at 8, 1.2-1.4x at 32-96, 0.82x at 256 (bench/kernels_cpu.py
--op linear_bf16); the engine 1.45x oneDNN's invariant plan on a 96-prompt run.

On CUDA the layers run batchapi.kernels.triton.matmul instead of cuBLAS: fixed tiles, no split-K.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchapi.engine.model import onednn
from batchapi.kernels.cpu import matmul
from batchapi.kernels.cpu.build import cpu_flags
from batchapi.kernels.cpu.memory import Arena

log = logging.getLogger(__name__)


class PackedLinear(nn.Linear):
    """An nn.Linear sharing the original's parameters, plus a packed copy of the weight."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, batch_hint: int) -> PackedLinear:
        packed = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        packed.weight, packed.bias = linear.weight, linear.bias  # shared: ties and state stay as they were
        packed.packed_weight = onednn.pack(linear.weight.detach(), batch_hint)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, self.packed_weight, self.bias)


class CKernelLinear(nn.Module):
    """A linear layer in one of kernels/cpu/matmul.py's C kernels, its weight kept only packed for it
    (``pack``), in the huge pages of ``arena`` (kernels/cpu/memory.py; ``pack_linears`` has one a
    model); each output one chain of sums in a fixed order, so invariant as it is."""

    def __init__(self, linear: nn.Linear, pack: Callable[[torch.Tensor], torch.Tensor], arena: Arena):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = arena.copy(pack(linear.weight))
        self.bias = linear.bias


class Bf16StoredLinear(CKernelLinear):
    """A float32 linear layer whose weight, exact in bf16, is stored in bf16 (packed for the C kernel);
    ``weight`` widens it back on demand (for the probe and tests, never on a step)."""

    def __init__(self, linear: nn.Linear, arena: Arena):
        super().__init__(linear, matmul.pack, arena)

    @property
    def weight(self) -> torch.Tensor:
        return matmul.unpack(self.packed_weight, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul.linear(x, self.packed_weight, self.out_features, self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).argmax(-1)``, the outputs never written (a greedy step's lm_head)."""
        return matmul.linear_argmax(x, self.packed_weight, self.out_features, self.bias)


class Avx512Bf16Linear(CKernelLinear):
    """A bf16 linear layer through the C kernel for AVX512-BF16 (kernels/cpu/matmul.py's
    ``linear_bf16``), its weight packed in pairs; ``weight`` unpacks it on demand (for the probe and
    tests, never on a step)."""

    def __init__(self, linear: nn.Linear, arena: Arena, screen: bool = False):
        """``screen``: a greedy lm_head's, whose ``argmax`` bounds most outputs in int8 first (the same
        choice; ``matmul.linear_bf16_argmax_screened``), where the kernel screens here."""
        super().__init__(linear, matmul.pack_pairs, arena)
        # the kernel's form of the bias (float32, whole panels), made once rather than on every call
        self.panel_bias = None if self.bias is None else matmul.panel_bias(self.bias, self.out_features)
        self.screen = matmul.pack_screen(linear.weight) if screen and matmul.screen_native() else None
        if self.screen is not None:
            self.screen = dataclasses.replace(self.screen, quads=arena.copy(self.screen.quads))
        self.screened_rows = self.exact_groups = 0  # the screen's tally, until it proves itself or is dropped

    @property
    def weight(self) -> torch.Tensor:
        return matmul.unpack_pairs(self.packed_weight, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul.linear_bf16(x, self.packed_weight, self.out_features, self.in_features, self.panel_bias)

    @property
    def fuses_silu(self) -> bool:
        """Whether ``silu_and_mul`` runs here: no bias, halves of whole panels, and ``forward`` not
        replaced on the instance (a profiler's wrapper must see the call)."""
        return self.bias is None and self.out_features % (2 * matmul.PANEL) == 0 and "forward" not in self.__dict__

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``elementwise.silu_and_mul(self.forward(x))`` for a gated MLP's [gate; up] projection, in one
        kernel (``matmul.linear_bf16_silu``): the same bits, the projection's outputs never written."""
        return matmul.linear_bf16_silu(x, self.packed_weight, self.out_features, self.in_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).argmax(-1)``, the outputs never written (a greedy step's lm_head)."""
        if self.screen is None:
            return matmul.linear_bf16_argmax(x, self.packed_weight, self.out_features, self.in_features,
                                             self.panel_bias)
        chosen, exact = matmul.linear_bf16_argmax_screened(x, self.packed_weight, self.screen, self.out_features,
                                                           self.in_features, self.panel_bias)
        self._tally(chosen.numel(), exact)
        return chosen

    def _tally(self, rows: int, exact: int) -> None:
        """Drop the screen where it computes too much exactly anyway (logits without a clear top, such as
        random weights'): over its first SCREEN_TRIAL_ROWS rows, more than SCREEN_MOST_EXACT of the
        rows' groups of columns. Either way the choices are the same."""
        if self.screened_rows >= SCREEN_TRIAL_ROWS:
            return
        self.screened_rows += rows
        self.exact_groups += exact
        if self.screened_rows >= SCREEN_TRIAL_ROWS:
            groups = -(-self.out_features // (3 * matmul.PANEL))
            share = self.exact_groups / (self.screened_rows * groups)
            if share > SCREEN_MOST_EXACT:
                self.screen = None
            log.info("the lm_head's int8 screen ran %.1f%% of its groups of columns exactly over %d rows: %s", 100 * share,
                     self.screened_rows, "dropped" if self.screen is None else "kept")


SCREEN_TRIAL_ROWS = 256
SCREEN_MOST_EXACT = 0.2


class AmxBf16Linear(Avx512Bf16Linear):
    """A bf16 linear layer through the C kernel on AMX tiles (kernels/cpu/matmul.py's ``linear_amx``),
    its weight packed in pairs as for AVX512-BF16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul.linear_amx(x, self.packed_weight, self.out_features, self.in_features, self.panel_bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return matmul.linear_amx_argmax(x, self.packed_weight, self.out_features, self.in_features, self.panel_bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """As ``Avx512Bf16Linear.silu_and_mul``, on AMX tiles (``matmul.linear_amx_silu``)."""
        return matmul.linear_amx_silu(x, self.packed_weight, self.out_features, self.in_features)


def can_run_amx(module: nn.Module) -> bool:
    """A bf16 CPU nn.Linear of whole 32-element chunks of K, where the C kernel built with AMX-BF16
    and the OS grants the tiles."""
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.bfloat16 and module.in_features % 32 == 0 and matmul.native_amx())


def can_run_avx512_bf16(module: nn.Module) -> bool:
    """A bf16 CPU nn.Linear, where the C kernel built with AVX512-BF16 and the CPU has no AMX (whose
    tiles oneDNN's kernel uses, about 3x the vector units' rate)."""
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.bfloat16 and matmul.native_bf16() and not _has_amx())


@functools.cache
def _has_amx() -> bool:
    return "amx_bf16" in cpu_flags().split()


def can_store_bf16(module: nn.Module) -> bool:
    """A float32 CPU nn.Linear whose weight bf16 holds exactly, where the C kernel built."""
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and matmul.available() and matmul.exact_in_bf16(module.weight))


def can_pack(module: nn.Module) -> bool:
    """bf16 only where native; where torch's oneDNN ops are gone or changed, no layer is packed."""
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype in (torch.bfloat16, torch.float32) and onednn.available(module.weight.dtype))


def pack_linears(model: nn.Module, batch_hint: int, bf16_weights: bool = False) -> dict[str, int]:
    """Replace every nn.Linear of ``model`` that can be in place: where ``bf16_weights`` (the engine's
    choice, ``EngineConfig.bf16_weights``; the embedding encoders' large batches keep oneDNN), a C
    kernel: bf16-stored where ``can_store_bf16``, bf16 on AMX tiles where ``can_run_amx``, bf16 on
    AVX512-BF16 where ``can_run_avx512_bf16``; else packed for oneDNN where ``can_pack``. Returns how
    many of each."""
    counts = {"bf16-stored": 0, "amx-bf16": 0, "avx512-bf16": 0, "onednn": 0}
    arena = Arena()  # the C kernels' packed weights, in huge pages
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        if bf16_weights and can_store_bf16(child):
            setattr(parent, name, Bf16StoredLinear(child, arena))
            counts["bf16-stored"] += 1
        elif bf16_weights and can_run_amx(child):
            setattr(parent, name, AmxBf16Linear(child, arena))
            counts["amx-bf16"] += 1
        elif bf16_weights and can_run_avx512_bf16(child):
            # a greedy lm_head (no softcap between it and the argmax) screened in int8
            head = parent is model and name == "lm_head" and not getattr(model, "final_softcap", None)
            setattr(parent, name, Avx512Bf16Linear(child, arena, screen=head))
            counts["avx512-bf16"] += 1
        elif can_pack(child):
            setattr(parent, name, PackedLinear.from_linear(child, batch_hint))
            counts["onednn"] += 1
    return counts


CANDIDATE_MIN_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 33, 48, 64)  # for padding: at most BLOCK_ROWS
# for a split layer: 96, 128, 192, 256, ..., 65536
CANDIDATE_WHOLE_ROWS = tuple(sorted({2**i for i in range(7, 17)} | {3 * 2**i for i in range(5, 15)}))
BLOCK_ROWS = 64  # the fallback's rows per call
SPLIT_MAX_ROWS = 32  # the most rows of a piece of a split call


class TritonLinear(nn.Module):
    """A linear layer through the batch-invariant Triton matmul (CUDA)."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner
        from batchapi.kernels.triton import matmul  # imports triton: CUDA only

        self._linear = matmul.linear

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.inner.weight, self.inner.bias)


class InvariantLinear(nn.Module):
    """A linear layer whose every row gets the same bits whatever the number of rows of the call:
    in fixed blocks of ``block_rows``; or one call from ``min_rows`` rows on (None: never) and,
    below, calls of at most ``split_rows`` rows, or without those one call padded to ``min_rows``."""

    def __init__(self, inner: nn.Module, min_rows: int | None, block_rows: int | None = None,
                 split_rows: int | None = None):
        super().__init__()
        assert min_rows is not None or split_rows is not None, "a padded layer needs its min rows"
        self.inner = inner  # nn.Linear or PackedLinear; its parameters stay where they were
        self.min_rows = min_rows
        self.block_rows = block_rows
        self.split_rows = split_rows

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.block_rows is not None:
            return _blocked(self.inner, x, self.block_rows)
        if self.min_rows is not None and rows >= self.min_rows:
            return self.inner.forward(x)
        if self.split_rows is None:
            return self.inner.forward(F.pad(x, (0, 0, 0, self.min_rows - rows)))[:rows]
        if rows <= self.split_rows:
            return self.inner.forward(x)
        return torch.cat([self.inner.forward(part) for part in x.split(self.split_rows)])


def _blocked(linear: nn.Module, x: torch.Tensor, block: int) -> torch.Tensor:
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, (-rows) % block))
    return torch.cat([linear(padded[i : i + block]) for i in range(0, padded.shape[0], block)])[:rows]


OCTAVE_STEPS = 8  # probed counts per octave of row counts


def probe_rows(min_rows: int, max_rows: int) -> list[int]:
    """The row counts compared against ``max_rows`` for a candidate ``min_rows``: every count up to
    twice the candidate (up to 2 * BLOCK_ROWS + 2: each count of a large candidate costs a large
    call), the counts next to each power of two (kernels switch at 2, 4, 12, 33) and
    eight counts an octave (every 4 rows from 32, every 16 from 128, every 256 from 2048). Each
    layer seen to change kernels past its smallest counts did so over a range of 100 counts or
    more somewhere (168..191 alone, in the old probe's random rows, was only what showed)."""
    counts = {min_rows, *range(min_rows, min(2 * min_rows + 2, 2 * BLOCK_ROWS + 2, max_rows) + 1)}
    power = 4
    while power <= max_rows:
        counts.update((power - 1, power + 1, *(power + power * i // OCTAVE_STEPS for i in range(OCTAVE_STEPS))))
        power *= 2
    counts.add(max_rows - 1)
    return sorted(c for c in counts if min_rows <= c < max_rows)  # max_rows itself is the reference call


NULL_COLUMNS = 256  # outputs cancelled in a row at most: bounds the QR of a wide layer
NULL_GROUPS = 4  # sets of cancelled outputs, spread over all outputs, taken in turn by the rows


def probe_input(weight: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """[rows, in] random rows, each nearly orthogonal to some rows of ``weight`` [out, in] (its null
    space where in > out), in the weight's dtype. Those outputs are near-cancellations: a few
    hundred times smaller than their terms, so bf16's rounding of them shows an fp32 sum taken in
    another order, which a random row's rounding hides but for about 1 output in 10^4."""
    out_features, in_features = weight.shape
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, in_features, generator=generator)  # [rows, in]
    k = min(out_features, in_features // 2, NULL_COLUMNS)
    if k == 0:
        return z.to(weight.dtype)
    groups = 1 if k == out_features else NULL_GROUPS
    w = weight.detach().float()
    x = torch.empty_like(z)
    for g in range(groups):
        outputs = (torch.arange(k) * groups + g) * out_features // (k * groups)
        basis, _ = torch.linalg.qr(w[outputs].T)  # [in, k]: orthonormal, spans those rows of the weight
        part = z[g::groups]
        x[g::groups] = part - (part @ basis) @ basis.T
    return (x / x.std()).to(weight.dtype)


class RowCounts(NamedTuple):
    """What the probe found for a layer: see the module's docstring."""

    whole_from: int | None  # the smallest count from which every count agrees with the largest call
    split_rows: int  # every count 1..split_rows agrees (0: not one row)


_cache: dict[str, list] = {}  # RowCounts as JSON lists
_lock = threading.Lock()
CACHE_FILE = "matmul-invariance.json"  # in the model cache directory: the probe costs seconds a shape
PROBE_VERSION = 3  # in the cache key: a changed probe does not trust what an older one found


@torch.inference_mode()
def invariant_row_counts(linear: nn.Module, max_rows: int, seed: int = 0) -> RowCounts:
    """``probe_row_counts`` for calls of up to ``max_rows`` rows, cached per probe version, CPU,
    torch version, shape, dtype, layout and threads, in memory and in a file of the model cache
    (BATCHAPI_MODEL_CACHE)."""
    weight = linear.weight
    key = "|".join(map(str, (f"probe{PROBE_VERSION}", _cpu_name(), torch.__version__,
                             torch.backends.cpu.get_cpu_capability(), type(linear).__name__,
                             tuple(weight.shape), weight.dtype, max_rows, torch.get_num_threads())))
    with _lock:
        if not _cache:
            _cache.update(_read_cache_file())
        if key not in _cache:
            _cache[key] = list(probe_row_counts(linear, max_rows, seed))
            _write_cache_file()
        return RowCounts(*_cache[key])


def _cache_path() -> Path:
    return Path(os.environ.get("BATCHAPI_MODEL_CACHE", "~/.cache/batchapi")).expanduser() / CACHE_FILE


def _read_cache_file() -> dict[str, list]:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache_file() -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(_cache, indent=0, sort_keys=True))
        partial.replace(path)  # atomic: another process reads the old file or the new one
    except OSError as exc:  # a read-only home: probe again next time
        log.info("could not write %s: %s", path, exc)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown cpu"


def probe_row_counts(linear: nn.Module, max_rows: int, seed: int = 0) -> RowCounts:
    """``invariant_row_counts`` uncached: compared on rows from ``probe_input``. A whole_from above
    BLOCK_ROWS is looked for only where small counts agree, as only a split layer uses one."""
    x = probe_input(linear.weight, max_rows, seed)
    full = linear(x)
    moved = torch.roll(x, shifts=max_rows // 3 + 1, dims=0)  # every row in another position
    if not torch.equal(linear(moved), torch.roll(full, shifts=max_rows // 3 + 1, dims=0)):
        return RowCounts(None, 0)
    same: dict[int, bool] = {}  # each count run once, and only while a candidate still needs it

    def agrees(m: int) -> bool:
        if m not in same:
            same[m] = _same_rows(linear, x, full, m)
        return same[m]

    def first_differing(candidate: int) -> int | None:  # ascending: a small count that differs costs little
        return next((m for m in probe_rows(candidate, max_rows) if not agrees(m)), None)

    split_rows = 0
    while split_rows < min(SPLIT_MAX_ROWS, max_rows - 1) and agrees(split_rows + 1):
        split_rows += 1
    candidates = [c for c in CANDIDATE_MIN_ROWS if c <= max_rows]
    candidates += [c for c in CANDIDATE_WHOLE_ROWS if split_rows and c < max_rows]  # max_rows: none compared
    return RowCounts(_whole_from(candidates, first_differing), split_rows)


def _whole_from(candidates: list[int], first_differing: Callable[[int], int | None]) -> int | None:
    """The first candidate whose counts all agree; one above BLOCK_ROWS bisected down to the count
    after the largest found to differ (a split layer splits every call below it)."""
    worst = 0  # the largest count found to differ: no candidate up to it can hold
    for candidate in candidates:
        if candidate <= worst:
            continue
        differs = first_differing(candidate)
        if differs is not None:
            worst = max(worst, differs)
            continue
        while candidate > BLOCK_ROWS and candidate - worst > 1:
            middle = (worst + candidate) // 2
            differs = first_differing(middle)
            if differs is None:
                candidate = middle
            else:
                worst = max(worst, differs)  # past the candidate: another count the candidate's probe missed
        if worst < candidate:
            return candidate
    return None


def _same_rows(linear: nn.Module, x: torch.Tensor, full: torch.Tensor, m: int) -> bool:
    """Whether a call of ``m`` rows gives the rows of the full call: counts a split call may run
    in windows covering the first 32 rows and one more placed by ``m``, larger ones in that one."""
    rows = x.shape[0]
    placed = (37 * m) % (rows - m + 1)
    starts = {*range(0, min(32, rows - m + 1), m), placed} if m <= SPLIT_MAX_ROWS else {placed}
    return all(torch.equal(linear(x[s : s + m]), full[s : s + m]) for s in starts)


def invariant_linear(linear: nn.Module, max_rows: int) -> nn.Module:
    """``linear`` as batch invariance runs it on CPU for calls of up to ``max_rows`` rows."""
    return invariant_layer(linear, invariant_row_counts(linear, max_rows))


def invariant_layer(linear: nn.Module, counts: RowCounts) -> nn.Module:
    """``linear`` run as ``counts`` allow: itself where its kernel is invariant from one row, else
    padded, split or in fixed blocks of BLOCK_ROWS (the module's docstring says when)."""
    whole_from, split_rows = counts
    if whole_from == 1:
        return linear  # no wrapper to call
    if whole_from is not None and whole_from <= BLOCK_ROWS:
        return InvariantLinear(linear, whole_from)
    if whole_from is not None and split_rows:
        return InvariantLinear(linear, whole_from, split_rows=split_rows)
    return InvariantLinear(linear, BLOCK_ROWS, block_rows=BLOCK_ROWS)


def plan_entry(layer: nn.Module) -> int | str:
    """How ``layer`` runs, for the log: the rows a call is padded to (1: as it is), "blocks", or
    "32-row pieces below 768"."""
    if not isinstance(layer, InvariantLinear):
        return 1
    if layer.block_rows is not None:
        return "blocks"
    if layer.split_rows is not None:
        return f"{layer.split_rows}-row pieces below {layer.min_rows}"
    return layer.min_rows


def make_invariant(model: nn.Module, device: torch.device, max_tokens: int,
                   max_logit_rows: int) -> dict[str, int | str]:
    """Wrap every linear layer of ``model`` in place; returns {layer shape: ``plan_entry`` or
    "triton"} for the log. ``lm_head`` sees at most ``max_logit_rows`` rows a step, the other
    layers ``max_tokens``."""
    plan: dict[str, int | str] = {}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear | CKernelLinear)]
    for parent, name, child in targets:
        shape = f"{name}:{child.in_features}x{child.out_features}"
        if isinstance(child, CKernelLinear):  # one fixed order per output: invariant as it is
            plan[shape] = 1
            continue
        if device.type == "cuda":
            setattr(parent, name, TritonLinear(child))
            plan[shape] = "triton"
            continue
        layer = invariant_linear(child, max_logit_rows if name == "lm_head" else max_tokens)
        setattr(parent, name, layer)
        plan[shape] = plan_entry(layer)
    blocked = [shape for shape, rows in plan.items() if rows == "blocks"]
    if blocked:
        log.warning("the matmuls of %s are not row-invariant on this CPU from any row count: they run in "
                    "fixed blocks of %d rows (slower)", ", ".join(blocked), BLOCK_ROWS)
    return plan

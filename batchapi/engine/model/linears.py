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

So each linear runs with at least ``min_rows`` rows, padded with zeros below that, where
``min_rows`` is the smallest row count from which this CPU's kernel gives every row the same bits
at every larger count up to the most rows a step can hold: found at load by ``min_invariant_rows``,
which compares row counts from each candidate up to that most (``probe_rows``), on the layer's own
weights. Padding costs only the smallest steps, whose matmuls read the weights anyway. Where no
candidate holds, the layer runs in fixed blocks of ``BLOCK_ROWS`` rows, each a call of one shape,
which gives a row the same bits in any block and at any place in it (on the AMX CPU in bf16:
SmolLM2's four projections and the test model's 512x192 down_proj; SmolLM2's lm_head pads to 33).

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

On CUDA the layers run batchapi.kernels.triton.matmul instead of cuBLAS: fixed tiles, no split-K.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batchapi.engine.model import onednn

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


def can_pack(module: nn.Module) -> bool:
    """bf16 only where native; where torch's oneDNN ops are gone or changed, no layer is packed."""
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype in (torch.bfloat16, torch.float32) and onednn.available(module.weight.dtype))


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every packable nn.Linear of ``model`` in place; returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if can_pack(child)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear.from_linear(child, batch_hint))
    return len(targets)


CANDIDATE_MIN_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 33, 48, 64)
BLOCK_ROWS = 64  # the fallback's rows per call


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
    """A linear layer whose every row gets the same bits whatever the number of rows of the call."""

    def __init__(self, inner: nn.Module, min_rows: int, block_rows: int | None = None):
        super().__init__()
        self.inner = inner  # nn.Linear or PackedLinear; its parameters stay where they were
        self.min_rows = min_rows
        self.block_rows = block_rows  # None: one call, padded to min_rows

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.block_rows is not None:
            return _blocked(self.inner, x, self.block_rows)
        if rows >= self.min_rows:
            return self.inner.forward(x)
        return self.inner.forward(F.pad(x, (0, 0, 0, self.min_rows - rows)))[:rows]


def _blocked(linear: nn.Module, x: torch.Tensor, block: int) -> torch.Tensor:
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, (-rows) % block))
    return torch.cat([linear(padded[i : i + block]) for i in range(0, padded.shape[0], block)])[:rows]


OCTAVE_STEPS = 8  # probed counts per octave of row counts


def probe_rows(min_rows: int, max_rows: int) -> list[int]:
    """The row counts compared against ``max_rows`` for a candidate ``min_rows``: every count up to
    twice the candidate, the counts next to each power of two (kernels switch at 2, 4, 12, 33) and
    eight counts an octave (every 4 rows from 32, every 16 from 128, every 256 from 2048). Each
    layer seen to change kernels past its smallest counts did so over a range of 100 counts or
    more somewhere (168..191 alone, in the old probe's random rows, was only what showed)."""
    counts = set(range(min_rows, min(2 * min_rows + 2, max_rows) + 1))
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


_cache: dict[str, int | None] = {}
_lock = threading.Lock()
CACHE_FILE = "matmul-invariance.json"  # in the model cache directory: the probe costs seconds a shape
PROBE_VERSION = 2  # in the cache key: a changed probe does not trust what an older one found


@torch.inference_mode()
def min_invariant_rows(linear: nn.Module, max_rows: int, seed: int = 0) -> int | None:
    """The smallest row count from which ``linear`` gives each row the same bits at any count up
    to ``max_rows`` (and in any position), or None. Cached per probe version, CPU, torch version,
    shape, dtype, layout and threads, in memory and in a file of the model cache
    (BATCHAPI_MODEL_CACHE)."""
    weight = linear.weight
    key = "|".join(map(str, (f"probe{PROBE_VERSION}", _cpu_name(), torch.__version__,
                             torch.backends.cpu.get_cpu_capability(), type(linear).__name__,
                             tuple(weight.shape), weight.dtype, max_rows, torch.get_num_threads())))
    with _lock:
        if not _cache:
            _cache.update(_read_cache_file())
        if key not in _cache:
            _cache[key] = probe_min_rows(linear, max_rows, seed)
            _write_cache_file()
        return _cache[key]


def _cache_path() -> Path:
    return Path(os.environ.get("BATCHAPI_MODEL_CACHE", "~/.cache/batchapi")).expanduser() / CACHE_FILE


def _read_cache_file() -> dict[str, int | None]:
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


def probe_min_rows(linear: nn.Module, max_rows: int, seed: int = 0) -> int | None:
    """``min_invariant_rows`` uncached: compared on rows from ``probe_input``."""
    x = probe_input(linear.weight, max_rows, seed)
    full = linear(x)
    moved = torch.roll(x, shifts=max_rows // 3 + 1, dims=0)  # every row in another position
    if not torch.equal(linear(moved), torch.roll(full, shifts=max_rows // 3 + 1, dims=0)):
        return None
    same: dict[int, bool] = {}  # each count run once, and only while a candidate still needs it
    worst = 0  # the largest count found to differ: no candidate up to it can hold
    for candidate in (c for c in CANDIDATE_MIN_ROWS if c <= max_rows):
        if candidate <= worst:
            continue
        for m in probe_rows(candidate, max_rows):  # ascending: a small count that differs costs little
            if m not in same:
                same[m] = _same_rows(linear, x, full, m)
            if not same[m]:
                worst = max(worst, m)
                break
        else:
            return candidate
    return None


def _same_rows(linear: nn.Module, x: torch.Tensor, full: torch.Tensor, m: int) -> bool:
    """Whether a call of ``m`` rows gives the rows of the full call: small counts in windows
    covering the first 32 rows, larger ones in one window placed by ``m``."""
    rows = x.shape[0]
    starts = range(0, min(32, rows - m + 1), m) if m <= 16 else ((37 * m) % (rows - m + 1),)
    return all(torch.equal(linear(x[s : s + m]), full[s : s + m]) for s in starts)


def invariant_linear(linear: nn.Module, max_rows: int) -> nn.Module:
    """``linear`` as batch invariance runs it on CPU for calls of up to ``max_rows`` rows: itself
    where its kernel is invariant from one row, else padded to the probe's min rows, else in
    fixed blocks of BLOCK_ROWS."""
    min_rows = min_invariant_rows(linear, max_rows)
    if min_rows is None:
        return InvariantLinear(linear, BLOCK_ROWS, block_rows=BLOCK_ROWS)
    return linear if min_rows == 1 else InvariantLinear(linear, min_rows)  # at 1: no wrapper to call


def make_invariant(model: nn.Module, device: torch.device, max_tokens: int,
                   max_logit_rows: int) -> dict[str, int | str]:
    """Wrap every linear layer of ``model`` in place; returns {layer shape: min rows, "blocks" or
    "triton"} for the log. ``lm_head`` sees at most ``max_logit_rows`` rows a step, the other
    layers ``max_tokens``."""
    plan: dict[str, int | str] = {}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        shape = f"{name}:{child.in_features}x{child.out_features}"
        if device.type == "cuda":
            setattr(parent, name, TritonLinear(child))
            plan[shape] = "triton"
            continue
        layer = invariant_linear(child, max_logit_rows if name == "lm_head" else max_tokens)
        setattr(parent, name, layer)
        if not isinstance(layer, InvariantLinear):
            plan[shape] = 1
        elif layer.block_rows is None:
            plan[shape] = layer.min_rows
        else:
            plan[shape] = "blocks"
    blocked = [shape for shape, rows in plan.items() if rows == "blocks"]
    if blocked:
        log.warning("the matmuls of %s are not row-invariant on this CPU from any row count: they run in "
                    "fixed blocks of %d rows (slower)", ", ".join(blocked), BLOCK_ROWS)
    return plan

"""Hot-path kernels of the engine: Triton on CUDA, each with a pure-torch twin (the CPU path).

`get_ops(mode, device)` picks the set (docs/CONTRACTS.md, "Kernels"). Files, one idea each:
- reference.py, attention_ref.py, rope.py: the twins and the rotary cache; torch only.
- attention.py, kvcache.py, norm.py, rotary_embedding.py, activation.py: Triton kernels with
  their launchers (shape, dtype and stride checks); imported only when Triton ops are asked for.
- native.py, csrc/paged_decode.c, csrc/elementwise.c, attention_cpu.py: the CPU path in C, compiled
  on first use (ctypes, no torch headers): paged attention of decode tokens and short prefill runs
  (the twin's SDPA keeps the long ones), the norms, rotary, SiLU-and-mul, the KV store and the
  greedy argmax.
- launch.py: what the launchers share: `jit` for the kernels, and running them under Triton's
  interpreter when the tensors are on CPU (the tests).
KV caches must be allocated zeroed: the twin reads the unwritten tail slots of a sequence's last
block (with zero weight), and NaN garbage there would leak through.
"""

from batchapi.kernels.attention_ref import paged_attention
from batchapi.kernels.ops import CPU_OPS, MODES, TORCH_OPS, Ops, get_ops
from batchapi.kernels.reference import fused_add_rms_norm, rms_norm, rotary, silu_and_mul, store_kvcache
from batchapi.kernels.rope import build_rope_cache

__all__ = [
    "CPU_OPS",
    "MODES",
    "TORCH_OPS",
    "Ops",
    "build_rope_cache",
    "fused_add_rms_norm",
    "get_ops",
    "paged_attention",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "store_kvcache",
]

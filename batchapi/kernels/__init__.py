"""Hot-path kernels of the engine: one table of ops, three sets of them (docs/CONTRACTS.md, "Kernels").

`get_ops(mode, device)` picks the set; ops.py holds the table (`Ops`) and the sets. Layout:
- torch/: the pure-torch twins, torch only: attention.py (paged attention), elementwise.py (KV
  store, norms, rotary, SiLU-and-mul, greedy argmax), bitmask.py (the grammar's token bitmask
  applied to logits), rope.py (the rotary cos/sin cache). They are the fallback of the other sets
  and the oracle of their tests.
- triton/: the Triton kernels with their launchers (shape, dtype and stride checks): attention.py,
  kvcache.py, norm.py, rotary.py, activation.py, bitmask.py, and launch.py, what the launchers
  share. Imported only when Triton ops are asked for.
- cpu/: the CPU path in C, compiled on first use (ctypes, no torch headers): build.py (compiler,
  cache directory, loading), attention.py (paged attention of decode tokens and short prefill runs;
  the twin's SDPA keeps the long ones), elementwise.py (norms, rotary, SiLU-and-mul, the KV store,
  the greedy argmax and the token bitmask), csrc/ (the C sources).
KV caches must be allocated zeroed: the twin reads the unwritten tail slots of a sequence's last
block (with zero weight), and NaN garbage there would leak through.
"""

from batchapi.kernels.ops import CPU_OPS, MODES, TORCH_OPS, Ops, get_ops
from batchapi.kernels.torch.rope import build_rope_cache

__all__ = [
    "CPU_OPS",
    "MODES",
    "TORCH_OPS",
    "Ops",
    "build_rope_cache",
    "get_ops",
]

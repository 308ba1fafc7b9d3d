"""Hot-path kernels of the engine: Triton on CUDA, each with a pure-torch twin (the CPU path)."""

from batchapi.kernels.attention_ref import paged_attention
from batchapi.kernels.ops import MODES, TORCH_OPS, Ops, get_ops
from batchapi.kernels.reference import fused_add_rms_norm, rms_norm, rotary, silu_and_mul, store_kvcache
from batchapi.kernels.rope import build_rope_cache

__all__ = [
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

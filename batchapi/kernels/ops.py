"""Choose the kernel set: Triton kernels on CUDA; on CPU the C kernels, falling back to the torch twins."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchapi.kernels import attention_cpu, attention_ref, native, reference
from batchapi.kernels.rope import build_rope_cache

MODES = ("auto", "triton", "cpu", "torch")


@dataclass(frozen=True)
class Ops:
    """The engine's hot-path operations; signatures in docs/CONTRACTS.md ("Kernels")."""

    name: str
    store_kvcache: Callable
    paged_attention: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    build_rope_cache: Callable = build_rope_cache


TORCH_OPS = Ops(
    name="torch",
    store_kvcache=reference.store_kvcache,
    paged_attention=attention_ref.paged_attention,
    rms_norm=reference.rms_norm,
    fused_add_rms_norm=reference.fused_add_rms_norm,
    rotary=reference.rotary,
    silu_and_mul=reference.silu_and_mul,
)

# C kernels (native.py): decode attention reads the KV blocks in place (attention_cpu.py); the
# elementwise ops run fused, one pass each. Tensors they do not take, and every op whose library
# failed to build, go to the torch twins.
CPU_OPS = Ops(
    name="cpu",
    store_kvcache=native.store_kvcache,
    paged_attention=attention_cpu.paged_attention,
    rms_norm=native.rms_norm,
    fused_add_rms_norm=native.fused_add_rms_norm,
    rotary=native.rotary,
    silu_and_mul=native.silu_and_mul,
)


def _triton_ops() -> Ops:
    # imported here so that nothing imports triton (or reads TRITON_INTERPRET) until asked
    attention = importlib.import_module("batchapi.kernels.attention")
    kvcache = importlib.import_module("batchapi.kernels.kvcache")
    norm = importlib.import_module("batchapi.kernels.norm")
    rotary_embedding = importlib.import_module("batchapi.kernels.rotary_embedding")
    activation = importlib.import_module("batchapi.kernels.activation")
    return Ops(
        name="triton",
        store_kvcache=kvcache.store_kvcache,
        paged_attention=attention.paged_attention,
        rms_norm=norm.rms_norm,
        fused_add_rms_norm=norm.fused_add_rms_norm,
        rotary=rotary_embedding.rotary,
        silu_and_mul=activation.silu_and_mul,
    )


def get_ops(mode: str = "auto", device: str | torch.device = "cpu") -> Ops:
    """mode auto: Triton on CUDA; elsewhere cpu, or torch where the C kernel cannot be built.
    mode triton on CPU needs TRITON_INTERPRET=1; mode cpu is for CPU tensors only."""
    assert mode in MODES, f"kernel mode must be one of {MODES}, got {mode!r}"
    device = torch.device(device)
    if mode == "auto":
        mode = "triton" if device.type == "cuda" else "cpu" if _any_native_built() else "torch"
    if mode == "cpu":
        assert device.type == "cpu", f"kernel mode cpu runs on CPU tensors, not {device}"
        assert _any_native_built(), "kernel mode cpu needs a C compiler (cc, gcc or $CC); see the log"
        return CPU_OPS
    return _triton_ops() if mode == "triton" else TORCH_OPS


def _any_native_built() -> bool:
    # each op of CPU_OPS whose library did not build runs its twin: one library is enough
    return native.load() is not None or native.load_elementwise() is not None

"""Choose the kernel set: Triton kernels on CUDA, their pure-torch twins elsewhere."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchapi.kernels import attention_ref, reference
from batchapi.kernels.rope import build_rope_cache

MODES = ("auto", "triton", "torch")


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
    """mode auto: Triton on CUDA, torch twins elsewhere. mode triton on CPU needs TRITON_INTERPRET=1."""
    assert mode in MODES, f"kernel mode must be one of {MODES}, got {mode!r}"
    device = torch.device(device)
    if mode == "auto":
        mode = "triton" if device.type == "cuda" else "torch"
    return _triton_ops() if mode == "triton" else TORCH_OPS

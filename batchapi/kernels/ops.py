"""The kernel sets and the choice between them: Triton on CUDA; on CPU the C kernels, else the torch twins."""

import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchapi.kernels.cpu import attention as cpu_attention
from batchapi.kernels.cpu import build as cpu_build
from batchapi.kernels.cpu import elementwise as cpu_elementwise
from batchapi.kernels.torch import attention as twin_attention
from batchapi.kernels.torch import bitmask as twin_bitmask
from batchapi.kernels.torch import elementwise as twin
from batchapi.kernels.torch import moe as twin_moe
from batchapi.kernels.torch.rope import build_rope_cache

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
    rotary_store: Callable  # rotary, then store_kvcache of the rotated k and of v -> the rotated q
    silu_and_mul: Callable
    argmax: Callable  # greedy pick of [B, V] logits -> [B] int64: the first of ties, NaN the largest
    apply_token_bitmask: Callable  # (logits [B, V], bitmask [R, W] int32, rows: list[int]) -> None, in place
    build_rope_cache: Callable = build_rope_cache
    # (x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k] int64) -> [T, H]
    fused_moe: Callable = twin_moe.fused_moe
    gelu_tanh_and_mul: Callable = twin.gelu_tanh_and_mul  # Gemma's gated MLP: [N, 2I] -> [N, I]
    invariant: bool = False  # batch invariant: each token's attention computed alike in every step


TORCH_OPS = Ops(
    name="torch",
    store_kvcache=twin.store_kvcache,
    paged_attention=twin_attention.paged_attention,
    rms_norm=twin.rms_norm,
    fused_add_rms_norm=twin.fused_add_rms_norm,
    rotary=twin.rotary,
    rotary_store=twin.rotary_store,
    silu_and_mul=twin.silu_and_mul,
    argmax=twin.argmax,
    apply_token_bitmask=twin_bitmask.apply_token_bitmask,
)

# C kernels (cpu/): decode attention reads the KV blocks in place; the elementwise ops run fused,
# one pass each. Tensors they do not take, and every op whose library failed to build, go to the
# torch twins.
CPU_OPS = Ops(
    name="cpu",
    store_kvcache=cpu_elementwise.store_kvcache,
    paged_attention=cpu_attention.paged_attention,
    rms_norm=cpu_elementwise.rms_norm,
    fused_add_rms_norm=cpu_elementwise.fused_add_rms_norm,
    rotary=cpu_elementwise.rotary,
    rotary_store=cpu_elementwise.rotary_store,
    silu_and_mul=cpu_elementwise.silu_and_mul,
    argmax=cpu_elementwise.argmax,
    apply_token_bitmask=cpu_elementwise.apply_token_bitmask,
)


@functools.cache
def _triton_ops() -> Ops:
    # imported here so that nothing imports triton until Triton ops are asked for
    attention = importlib.import_module("batchapi.kernels.triton.attention")
    kvcache = importlib.import_module("batchapi.kernels.triton.kvcache")
    norm = importlib.import_module("batchapi.kernels.triton.norm")
    rotary = importlib.import_module("batchapi.kernels.triton.rotary")
    activation = importlib.import_module("batchapi.kernels.triton.activation")
    bitmask = importlib.import_module("batchapi.kernels.triton.bitmask")
    moe = importlib.import_module("batchapi.kernels.triton.moe")
    return Ops(
        name="triton",
        store_kvcache=kvcache.store_kvcache,
        paged_attention=attention.paged_attention,
        rms_norm=norm.rms_norm,
        fused_add_rms_norm=norm.fused_add_rms_norm,
        rotary=rotary.rotary,
        rotary_store=functools.partial(_rotary_then_store, rotary.rotary, kvcache.store_kvcache),
        silu_and_mul=activation.silu_and_mul,
        argmax=twin.argmax,  # torch.argmax on CUDA: one pass, no kernel of ours to win there
        apply_token_bitmask=bitmask.apply_token_bitmask,
        fused_moe=moe.fused_moe,
        gelu_tanh_and_mul=activation.gelu_tanh_and_mul,
    )


def _rotary_then_store(rotary, store_kvcache, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    q, k = rotary(q, k, positions, cos_sin)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return q


def get_ops(mode: str = "auto", device: str | torch.device = "cpu", invariant: bool = False) -> Ops:
    """mode auto: Triton on CUDA; elsewhere cpu, or torch where the C kernels cannot be built.
    mode triton on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1 set before triton is
    imported); mode cpu is for CPU tensors only. invariant: the batch-invariant attention of the
    set (every other op is computed per row or per element, the same whatever the batch)."""
    assert mode in MODES, f"kernel mode must be one of {MODES}, got {mode!r}"
    device = torch.device(device)
    if mode == "auto":
        mode = "triton" if device.type == "cuda" else "cpu" if _any_c_built() else "torch"
    if mode == "cpu":
        assert device.type == "cpu", f"kernel mode cpu runs on CPU tensors, not {device}"
        assert _any_c_built(), "kernel mode cpu needs a C compiler (cc, gcc or $CC); see the log"
        ops = CPU_OPS
    else:
        ops = _triton_ops() if mode == "triton" else TORCH_OPS
    return _invariant(ops) if invariant else ops


def _invariant(ops: Ops) -> Ops:
    if ops.name == "torch":
        attention = twin_attention.invariant_paged_attention
    else:  # the C and the Triton kernels take the flag themselves
        attention = functools.partial(ops.paged_attention, invariant=True)
    return dataclasses.replace(ops, paged_attention=attention, invariant=True)


def _any_c_built() -> bool:
    # each op of CPU_OPS whose library did not build runs its twin: one library is enough
    return cpu_build.load() is not None or cpu_build.load_elementwise() is not None

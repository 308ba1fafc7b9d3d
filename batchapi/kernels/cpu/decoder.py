"""A Llama-family decoder's layers in one C call a step (csrc/decoder.c): the same kernels the model's
Python calls one by one (elementwise.py's norms, rotary-and-store and SiLU-and-mul, attention.py's
paged decode, matmul.py's bf16 and AMX linear layers, or in float32 its bf16-stored ones), with the same
arguments, so the same bits; the Python between them (~300 calls a step: checks, torch.empty, ctypes)
is gone.

``DecoderLayers`` takes each layer's tensors once; ``run`` takes a step, or returns None where the
step is not one it runs as the Python path would (a prefill run the attention's torch twin takes, a
kernel refusing its arguments): the caller then runs the layers in Python, which raises what it raises.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from batchapi.kernels.cpu import attention, build
from batchapi.kernels.cpu.elementwise import MAX_ROTARY_DIM
from batchapi.kernels.cpu.matmul import PANEL  # the *_silu kernels take gate and up halves of whole panels

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# matmul.c's entry points a projection may run, by the layers' dtype
LINEAR_KERNELS = {torch.bfloat16: ("linear_bf16", "linear_amx"), torch.float32: ("linear_bf16w",)}
# a gate_up projection's kernel -> the one that also runs SiLU-and-mul (the same bits, its outputs unwritten)
WITH_ACT = {"linear_bf16": "linear_bf16_silu", "linear_amx": "linear_amx_silu"}


class _Kernels(ctypes.Structure):
    _fields_ = [("norm", _p), ("act", _p), ("rotary_store", _p), ("attention", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv_fn", _p), ("o_fn", _p), ("gate_up_fn", _p), ("down_fn", _p), ("gate_act_fn", _p),
                ("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p), ("qkv_bias", _p),
                ("input_norm", _p), ("post_norm", _p), ("k_cache", _p), ("v_cache", _p), ("cos_sin", _p),
                ("cs_stride", _i64), ("max_pos", _i64), ("cs_bf16", _i32), ("window", _i32)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("inter", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64), ("block_size", _i64),
                ("num_slots", _i64), ("eps", _f32), ("scale", _f32), ("bf16", _i32)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _i64), ("positions", _p), ("slots", _p), ("slots_i64", _i32),
                ("tables", _p), ("context_lens", _p), ("q_rows", _p), ("rows", _p), ("table_stride", _i64),
                ("x", _p), ("mlp_out", _p), ("residual", _p * 2), ("normed", _p), ("qkv", _p), ("q", _p),
                ("attn", _p), ("gate_up", _p), ("act", _p),
                ("num_waves", _i64), ("wave_ends", _p), ("copy_src", _p), ("copy_dst", _p), ("copy_rows", _p)]


@dataclass
class Layer:
    """One layer's tensors. A projection is (its matmul.py kernel, a LINEAR_KERNELS name; its packed
    weight: ``pack_pairs``, or ``pack`` for linear_bf16w); ``qkv_bias`` as that kernel takes it
    (``panel_bias`` form for the bf16 ones) or None; the caches [num_blocks, block_size, Hkv, D];
    ``cos_sin`` [max_pos, D]; ``window`` 0 for the whole context. Norms, caches and activations all of
    one dtype, bf16 or float32."""

    qkv: tuple[str, torch.Tensor]
    o: tuple[str, torch.Tensor]
    gate_up: tuple[str, torch.Tensor]
    down: tuple[str, torch.Tensor]
    qkv_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cos_sin: torch.Tensor
    window: int = 0


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class DecoderLayers:
    """A model's layers for ``run``; ``usable`` says whether this machine and these tensors allow it."""

    def __init__(self, layers: list[Layer], hidden: int, inter: int, hq: int, hkv: int, d: int, eps: float,
                 scale: float):
        self.layers = layers  # held: the C side keeps their addresses
        self.hidden, self.inter, self.hq, self.hkv, self.d = hidden, inter, hq, hkv, d
        self.dtype = layers[0].input_norm.dtype if layers else torch.bfloat16
        self.lib = build.load_decoder()
        libs = (build.load_elementwise(), build.load(), build.load_matmul())
        self.usable = self.lib is not None and None not in libs and bool(layers) and self._takes(layers)
        self.act_in_gate_up = False
        if not self.usable:
            return
        elementwise, decode, matmul = libs
        self._kernels = _Kernels(_address(elementwise, "rms_norm"), _address(elementwise, "silu_and_mul"),
                                 _address(elementwise, "rotary_store"),
                                 _address(decode, f"paged_decode_{build.DTYPES[self.dtype]}"))
        cache = layers[0].k_cache
        self._shape = _Shape(hidden, inter, hq, hkv, d, cache.shape[1], cache.shape[0] * cache.shape[1], eps, scale,
                             self.dtype is torch.bfloat16)
        self._windows = sorted({layer.window for layer in layers})
        table = (_Layer * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                kernel, packed = getattr(layer, name)
                setattr(entry, name + "_fn", _address(matmul, kernel))
                setattr(entry, name, packed.data_ptr())
            kernel = WITH_ACT.get(layer.gate_up[0])
            entry.gate_act_fn = _address(matmul, kernel) if kernel and inter % PANEL == 0 else None
            entry.qkv_bias = layer.qkv_bias.data_ptr() if layer.qkv_bias is not None else None
            entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            entry.k_cache, entry.v_cache = layer.k_cache.data_ptr(), layer.v_cache.data_ptr()
            entry.cos_sin, entry.cs_stride = layer.cos_sin.data_ptr(), layer.cos_sin.stride(0)
            entry.max_pos, entry.cs_bf16 = layer.cos_sin.shape[0], layer.cos_sin.dtype is torch.bfloat16
            entry.window = layer.window
        self._table = table
        self.act_in_gate_up = all(entry.gate_act_fn for entry in table)  # SiLU-and-mul in every gate_up: none writes it

    def _takes(self, layers: list[Layer]) -> bool:
        """The shapes and dtypes each wrapper would pass straight to its kernel."""
        d, hq, hkv, dtype = self.d, self.hq, self.hkv, self.dtype
        if dtype not in LINEAR_KERNELS:
            return False
        if hkv <= 0 or hq % hkv or hq // hkv > attention.MAX_GROUP or d % 2 or d > min(attention.MAX_HEAD_DIM,
                                                                                         MAX_ROTARY_DIM):
            return False
        cache = layers[0].k_cache
        if cache.dim() != 4 or cache.shape[1] > attention.MAX_BLOCK or tuple(cache.shape[2:]) != (hkv, d):
            return False
        for layer in layers:
            caches = (layer.k_cache, layer.v_cache)
            if any(c.shape != cache.shape or c.dtype != dtype or not c.is_contiguous() or not c.is_cpu for c in caches):
                return False
            if any(getattr(layer, name)[0] not in LINEAR_KERNELS[dtype] for name in ("qkv", "o", "gate_up", "down")):
                return False
            norms = (layer.input_norm, layer.post_norm)
            if any(n.shape != (self.hidden,) or n.dtype != dtype or not n.is_contiguous() for n in norms):
                return False
            cos_sin = layer.cos_sin
            if cos_sin.dim() != 2 or cos_sin.shape[1] != d or cos_sin.stride(1) != 1 or cos_sin.dtype not in (
                    torch.float32, torch.bfloat16):
                return False
        return True

    def run(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, invariant: bool,
            kv_copies: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layers on the embeddings x [T, hidden] (the layers' dtype) -> (the last layer's output, its
        residual), as the Python loop over DecoderLayer.forward gives them; None where the step is not one
        it runs. ``kv_copies``: the step's (source slots, destination slots) waves (AttentionMetadata's),
        copied in every layer after its KV store as the loop copies them."""
        tokens = x.shape[0]
        if (not self.usable or tokens == 0 or x.dtype is not self.dtype or x.shape != (tokens, self.hidden)
                or not x.is_contiguous() or positions.shape != (tokens,) or slot_mapping.shape != (tokens,)
                or slot_mapping.dtype not in (torch.int32, torch.int64)):
            return None
        cache = self.layers[0].k_cache
        for window in self._windows:  # the plan the attention wrapper makes, its tables checked per window
            plan = attention._plan(block_tables, cu_seqlens_q, context_lens, cache.shape[0], cache.shape[1],
                                   invariant, window)
        if plan.prefills or plan.rows.numel() != tokens or plan.num_tokens != tokens:
            return None  # a prefill run goes to the torch twin: the Python path
        hidden, qs, kvs, dtype = self.hidden, self.hq * self.d, self.hkv * self.d, self.dtype
        copies = _copies(kv_copies, kvs, dtype)
        if copies is None:
            return None
        positions = positions.to(torch.int64).contiguous()
        slot_mapping = slot_mapping.contiguous()
        mlp_out, residual, other, normed = (torch.empty(tokens, hidden, dtype=dtype) for _ in range(4))
        qkv = torch.empty(tokens, qs + 2 * kvs, dtype=dtype)
        q, attn = torch.empty(tokens, qs, dtype=dtype), torch.empty(tokens, qs, dtype=dtype)
        act = torch.empty(tokens, self.inter, dtype=dtype)
        gate_up = act if self.act_in_gate_up else torch.empty(tokens, 2 * self.inter, dtype=dtype)
        step = _Step(tokens, positions.data_ptr(), slot_mapping.data_ptr(), slot_mapping.dtype is torch.int64,
                     plan.tables.data_ptr(), plan.context_lens.data_ptr(), plan.q_rows.data_ptr(),
                     plan.rows.data_ptr(), plan.tables.stride(0), x.data_ptr(), mlp_out.data_ptr(),
                     (_p * 2)(residual.data_ptr(), other.data_ptr()), normed.data_ptr(), qkv.data_ptr(),
                     q.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(), len(kv_copies),
                     *(t.data_ptr() for t in copies))
        rc = self.lib.decoder_layers(ctypes.byref(self._kernels), ctypes.byref(self._shape), self._table,
                                     len(self.layers), ctypes.byref(step), torch.get_num_threads())
        return None if rc else (mlp_out, residual)


_NO_COPIES = (torch.empty(0, dtype=torch.int64),) * 4  # a step without copies: nothing the C side reads


def _copies(kv_copies, row: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """(wave ends, source slots, destination slots, a wave's rows) for the C call: int64, contiguous, one
    array for all waves (empty ones for none); None where a wave's slots are not int64 CPU vectors of one length
    (the loop's indexing says what it says of them)."""
    if not kv_copies:
        return _NO_COPIES
    if any(s.dtype != torch.int64 or d.dtype != torch.int64 or s.dim() != 1 or s.shape != d.shape
           or not s.is_cpu or not d.is_cpu for s, d in kv_copies):
        return None
    lengths = [s.numel() for s, _ in kv_copies]
    ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    src, dst = torch.cat([s for s, _ in kv_copies]), torch.cat([d for _, d in kv_copies])
    return ends, src, dst, torch.empty(max(lengths), row, dtype=dtype)

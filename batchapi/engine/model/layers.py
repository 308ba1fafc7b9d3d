"""The layers the model families share: paged attention (with an optional sliding window, soft-cap and
q/k norm), the gated MLP, the RMSNorm weight holder, and the metadata attention reads a step's
sequences from.

Tokens of all sequences in a step are packed into one flat batch [T]; attention finds each
sequence's keys and values through its block table. q/k/v and gate/up projections are fused
into one matmul each (the loader concatenates the checkpoint's weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from batchapi.engine.model.loader import ModelConfig
from batchapi.kernels.cpu import elementwise as cpu_elementwise


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, KV slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, pad -1
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32, KV length including this step's tokens
    max_seqlen_q: int  # host-side maxima, so the kernels need not read them from the device
    max_context_len: int
    # KV slots copied in each layer after the store, wave by wave: [(src [C] int64, dst [C] int64)]
    kv_copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class RMSNorm(nn.Module):
    """The weight of an RMSNorm the ops compute; Gemma's (1 + w) is folded into it at load."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def input_norm(ops, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
    """A layer's input norm -> (normed, residual): of x alone in the first layer (x becomes the
    residual), else of x added to the residual."""
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), x
    return ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, layer: int):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.window = cfg.window(layer)  # 0: the whole context
        self.softcap = cfg.gemma.attn_softcap if cfg.gemma else 0.0
        self.local_rope = layer in cfg.local_layers  # which of the model's rope tables this layer reads
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_cache = self.v_cache = torch.empty(0)  # set by the model runner

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ropes: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, (Hq + 2 Hkv) D] (forward: no module hooks in this loop)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head's q and k normed over D, before rope (Qwen3, Gemma 3)
            q = self._head_norm(q, self.q_norm)
            k = self._head_norm(k, self.k_norm)
        cos_sin = ropes[self.local_rope]
        q = self.ops.rotary_store(q, k, v, positions, cos_sin, self.k_cache, self.v_cache, meta.slot_mapping)
        for src, dst in meta.kv_copies:  # prefix reuse inside a block (scheduler.KVCopy)
            for cache in (self.k_cache, self.v_cache):
                flat = cache.view(-1, self.num_kv_heads, self.head_dim)  # [num_slots, Hkv, D]
                flat[dst] = flat[src]
        out = self.ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                       meta.cu_seqlens_q, meta.context_lens, self.scale,
                                       window=self.window, softcap=self.softcap,
                                       max_seqlen_q=meta.max_seqlen_q,
                                       max_context_len=meta.max_context_len)  # [T, Hq, D]
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))

    def _head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        tokens, heads, dim = x.shape
        return self.ops.rms_norm(x.reshape(tokens * heads, dim), norm.weight, norm.eps).view(tokens, heads, dim)


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), act SiLU (Llama) or tanh-approximated GELU (Gemma)."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.act_and_mul = ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_tanh" else ops.silu_and_mul
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.act_and_mul is cpu_elementwise.silu_and_mul and getattr(gate_up, "fuses_silu", False):
            return self.down_proj.forward(gate_up.silu_and_mul(x))  # SiLU in the C kernel's epilogue
        return self.down_proj.forward(self.act_and_mul(gate_up.forward(x)))  # [T, H]

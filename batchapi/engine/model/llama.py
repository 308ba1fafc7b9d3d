"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2; with sparse MoE MLPs, Qwen3-MoE
and Mixtral) over a paged KV cache.

Tokens of all sequences in a step are packed into one flat batch [T]; attention finds each
sequence's keys and values through its block table. q/k/v and gate/up projections are fused
into one matmul each (the loader concatenates the checkpoint's weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from batchapi.engine.model.loader import ModelConfig
from batchapi.engine.model.moe import SparseMoE


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_cache = self.v_cache = torch.empty(0)  # set by the model runner

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, (Hq + 2 Hkv) D] (forward: no module hooks in this loop)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head's q and k normed over D, before rope (Qwen3)
            q = self._head_norm(q, self.q_norm)
            k = self._head_norm(k, self.k_norm)
        q = self.ops.rotary_store(q, k, v, positions, cos_sin, self.k_cache, self.v_cache, meta.slot_mapping)
        for src, dst in meta.kv_copies:  # prefix reuse inside a block (scheduler.KVCopy)
            for cache in (self.k_cache, self.v_cache):
                flat = cache.view(-1, self.num_kv_heads, self.head_dim)  # [num_slots, Hkv, D]
                flat[dst] = flat[src]
        out = self.ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                       meta.cu_seqlens_q, meta.context_lens, self.scale,
                                       max_seqlen_q=meta.max_seqlen_q,
                                       max_context_len=meta.max_context_len)  # [T, Hq, D]
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))

    def _head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        tokens, heads, dim = x.shape
        return self.ops.rms_norm(x.reshape(tokens * heads, dim), norm.weight, norm.eps).view(tokens, heads, dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.ops.silu_and_mul(self.gate_up_proj.forward(x)))  # [T, H]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, index: int):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(cfg, ops)
        moe = cfg.moe
        if moe is not None and index in moe.sparse_layers:
            self.mlp = SparseMoE(cfg.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.normalize,
                                 moe.weights_in_dtype, ops)
        else:
            self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, cos_sin, meta):
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, self.ops.rms_norm(x, norm.weight, norm.eps)
        else:
            x, residual = self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn.forward(x, positions, cos_sin, meta)
        norm = self.post_attention_layernorm
        x, residual = self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp.forward(x), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)  # [max_pos, D], set by the runner

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logit_rows [S] token indices to score -> logits [S, V] in the
        model's dtype (the sampler works in fp32 where it needs to; greedy needs no copy)."""
        x, residual = self.embed_tokens(input_ids), None  # [T, H]
        cos_sin = self.cos_sin
        for layer in self.layers:  # each module's forward called straight: a step makes ~400 such calls
            x, residual = layer.forward(x, residual, positions, cos_sin, meta)
        x = x.index_select(0, logit_rows)  # [S, H]: only the tokens that get sampled
        residual = residual.index_select(0, logit_rows)
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return self.lm_head.forward(x)  # [S, V]

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up."""
        tied = self.cfg.tie_word_embeddings or "lm_head.weight" not in tensors
        if tied:  # moving the module between devices unties the shared parameter
            self.lm_head.weight = self.embed_tokens.weight
        own = dict(self.named_parameters())
        done = set()

        def put(name: str, value: torch.Tensor) -> None:
            param = own[name]
            assert param.shape == value.shape, f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(param.shape)}"
            param.data.copy_(value)
            done.add(name)

        for i in range(self.cfg.num_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            attn = hf + "self_attn."
            put(me + "self_attn.qkv_proj.weight", torch.cat([tensors[attn + p + "_proj.weight"] for p in "qkv"]))
            if self.cfg.qkv_bias:
                put(me + "self_attn.qkv_proj.bias", torch.cat([tensors[attn + p + "_proj.bias"] for p in "qkv"]))
            put(me + "self_attn.o_proj.weight", tensors[attn + "o_proj.weight"])
            if self.cfg.qk_norm:
                put(me + "self_attn.q_norm.weight", tensors[attn + "q_norm.weight"])
                put(me + "self_attn.k_norm.weight", tensors[attn + "k_norm.weight"])
            if isinstance(self.layers[i].mlp, SparseMoE):
                for name, value in moe_tensors(tensors, hf, self.cfg.moe.num_experts):
                    put(me + name, value)
            else:
                put(me + "mlp.gate_up_proj.weight",
                    torch.cat([tensors[hf + "mlp.gate_proj.weight"], tensors[hf + "mlp.up_proj.weight"]]))
                put(me + "mlp.down_proj.weight", tensors[hf + "mlp.down_proj.weight"])
            put(me + "input_layernorm.weight", tensors[hf + "input_layernorm.weight"])
            put(me + "post_attention_layernorm.weight", tensors[hf + "post_attention_layernorm.weight"])
        put("embed_tokens.weight", tensors["model.embed_tokens.weight"])
        put("norm.weight", tensors["model.norm.weight"])
        if not tied:
            put("lm_head.weight", tensors["lm_head.weight"])
        missing = set(own) - done
        assert not missing, f"weights missing from the checkpoint: {sorted(missing)[:5]}"


def moe_tensors(tensors: dict[str, torch.Tensor], layer: str, num_experts: int):
    """(our name, tensor) of one layer's router and experts, from a checkpoint of one expert a tensor
    (Qwen3-MoE's ``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1``, w3 the up,
    w2 the down projection) or of fused 3-D experts (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I], as transformers holds them in memory)."""
    prefix = layer + ("block_sparse_moe." if layer + "block_sparse_moe.gate.weight" in tensors else "mlp.")
    yield "mlp.gate.weight", tensors[prefix + "gate.weight"]
    fused = tensors.get(prefix + "experts.gate_up_proj")
    for e in range(num_experts):
        ours = f"mlp.experts.{e}."
        if fused is not None:
            gate_up, down = fused[e], tensors[prefix + "experts.down_proj"][e]
        elif prefix.endswith("block_sparse_moe."):
            theirs = f"{prefix}experts.{e}."
            gate_up = torch.cat([tensors[theirs + "w1.weight"], tensors[theirs + "w3.weight"]])
            down = tensors[theirs + "w2.weight"]
        else:
            theirs = f"{prefix}experts.{e}."
            gate_up = torch.cat([tensors[theirs + "gate_proj.weight"], tensors[theirs + "up_proj.weight"]])
            down = tensors[theirs + "down_proj.weight"]
        yield ours + "gate_up_proj.weight", gate_up
        yield ours + "down_proj.weight", down

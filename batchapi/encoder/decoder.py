"""A decoder embedding model (Qwen3-Embedding and the like: a Llama-family ``*Model`` with
last-token pooling) on the engine's own model code, without a KV cache.

The engine's ``CausalLM`` holds the weights (fused q/k/v and gate/up, oneDNN-packed on CPU) and its
kernels the norms and rotary; what differs is attention: an input is encoded once, so each layer
runs one causal SDPA over the right-padded batch [B, H, S, D] instead of the paged cache. Right
padding needs no mask: a causal query never sees the pads after it, and every row starts at
position 0 (a left-padded peer's rows start later, which rotary's relative positions make alike).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batchapi.engine.model.layers import Attention, input_norm
from batchapi.engine.model.linears import pack_linears
from batchapi.engine.model.llama import CausalLM
from batchapi.engine.model.loader import ModelConfig, UnsupportedModelError, load_config, load_weights
from batchapi.engine.model_runner import materialize
from batchapi.kernels import get_ops

DECODER_TYPES = {"llama", "mistral", "qwen2", "qwen3"}  # config.json model_type: run by this module
PACK_BATCH_HINT = 4096  # rows of a typical forward: oneDNN's blocking for the packed weights


def with_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A base model's tensors (``layers.0...``, as ``Qwen3Model`` saves them) by the causal LM's names."""
    return {name if name.startswith(("model.", "lm_head.")) else "model." + name: t for name, t in tensors.items()}


class DecoderBackbone:
    shares_prefix = True  # hidden() runs a prefix the rows share once

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype):
        cfg: ModelConfig = load_config(path)
        if cfg.gemma is not None or cfg.moe is not None:
            raise UnsupportedModelError(f"{cfg.architecture} is not run as an embedding model")
        self.cfg = cfg
        self.ops = get_ops("auto", device)
        with torch.device("meta"):
            model = CausalLM(cfg, self.ops)
        model = materialize(model.to(dtype), device)
        model.load(with_prefix(load_weights(path)))
        model.lm_head = nn.Identity()  # no logits: nothing to pack or keep beside the embeddings
        model.cos_sin = self.ops.build_rope_cache(cfg.head_dim, cfg.context_limit, cfg.rope_theta, cfg.rope_scaling,
                                                  device, dtype, cfg.max_position_embeddings)  # [max_pos, D]
        self.model = model.eval().requires_grad_(False)
        if device.type == "cpu":
            pack_linears(self.model, batch_hint=PACK_BATCH_HINT)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.device = device

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, lengths: torch.Tensor, prefix: int = 0) -> torch.Tensor:
        """input_ids [B, S] right-padded (lengths [B]) -> the last hidden states [B, S, H]. prefix: the
        first ``prefix`` ids of every row are the same (a shared prompt) and every row is longer: they
        are run once, and the rest of each row attends to their keys and values. Exact, as a causal
        model's first tokens see nothing after them."""
        if not prefix:
            return self._forward(input_ids, 0, None)
        kv: list = []
        head = self._forward(input_ids[:1, :prefix], 0, None, kv)  # [1, P, H]
        tail = self._forward(input_ids[:, prefix:], prefix, kv)  # [B, S - P, H]
        return torch.cat([head.expand(input_ids.shape[0], -1, -1), tail], dim=1)

    def _forward(self, input_ids: torch.Tensor, start: int, past: list | None,
                 keep: list | None = None) -> torch.Tensor:
        """Rows [B, S] at positions start.. after ``past`` (each layer's prefix keys and values, [1, Hkv,
        start, D] each); ``keep``: a list each layer's keys and values are appended to."""
        batch, seq = input_ids.shape
        model, ops = self.model, self.ops
        positions = torch.arange(start, start + seq, device=input_ids.device).repeat(batch)  # [B*S]
        x, residual = model.embed_tokens(input_ids.reshape(-1)), None  # [B*S, H]
        for i, layer in enumerate(model.layers):
            x, residual = input_norm(ops, x, residual, layer.input_layernorm)
            x = self._attention(layer.self_attn, x, positions, batch, start, past[i] if past else None, keep)
            norm = layer.post_attention_layernorm
            x, residual = ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
            x = layer.mlp.forward(x)
        x, _ = ops.fused_add_rms_norm(x, residual, model.norm.weight, model.norm.eps)
        return x.view(batch, seq, -1)

    def _attention(self, attn: Attention, x: torch.Tensor, positions: torch.Tensor, batch: int, start: int,
                   past: tuple[torch.Tensor, torch.Tensor] | None, keep: list | None) -> torch.Tensor:
        tokens = x.shape[0]
        seq = tokens // batch
        q, k, v = attn.qkv_proj.forward(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(tokens, attn.num_heads, attn.head_dim)  # [T, Hq, D]
        k = k.view(tokens, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
        if attn.q_norm is not None:  # each head's q and k normed over D before rope (Qwen3)
            q = self._head_norm(q, attn.q_norm)
            k = self._head_norm(k, attn.k_norm)
        q, k = self.ops.rotary(q, k, positions, self.model.cos_sin)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, S, D]
            return t.reshape(batch, seq, t.shape[1], attn.head_dim).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v.reshape(tokens, attn.num_kv_heads, attn.head_dim))
        if keep is not None:
            keep.append((k, v))
        if past is not None:  # the shared prefix's [1, Hkv, P, D] before every row's own
            k = torch.cat([past[0].expand(batch, -1, -1, -1), k], dim=2)
            v = torch.cat([past[1].expand(batch, -1, -1, -1), v], dim=2)
        mask = None
        if past is not None or attn.window:  # queries at start.., keys at 0..: causal by position
            q_pos = torch.arange(start, start + seq, device=x.device)[:, None]
            k_pos = torch.arange(k.shape[2], device=x.device)[None, :]
            mask = k_pos <= q_pos  # [S, P + S]
            if attn.window:  # a query sees itself and the window - 1 keys before it
                mask &= k_pos > q_pos - attn.window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scale,
                                             enable_gqa=True)  # [B, Hq, S, D]
        return attn.o_proj.forward(out.transpose(1, 2).reshape(tokens, attn.q_size))

    def _head_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        tokens, heads, dim = x.shape
        return self.ops.rms_norm(x.reshape(tokens * heads, dim), norm.weight, norm.eps).view(tokens, heads, dim)

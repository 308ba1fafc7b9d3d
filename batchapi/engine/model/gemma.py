"""Gemma 2 and Gemma 3 text decoders: the Llama layout (engine.model.llama.CausalLM) with

- "sandwich" norms: each of attention and MLP normed on the way in and on the way out, before it
  joins the residual (input, post-attention, pre- and post-feedforward norms);
- RMSNorms that scale by (1 + w): folded into the weight at load (``norm_weight``), which in fp32
  is transformers' computation exactly;
- the embeddings scaled by sqrt(hidden) in the model's dtype, a GELU-tanh gated MLP, the query scaled
  by query_pre_attn_scalar ** -0.5;
- interleaved local (sliding-window) and global layers; Gemma 3's local layers have a rope base of
  their own, and q/k norms; Gemma 2 soft-caps the attention logits and the output logits.
"""

from __future__ import annotations

import torch
from torch import nn

from batchapi.engine.model.layers import MLP, Attention, RMSNorm, input_norm
from batchapi.engine.model.loader import ModelConfig

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def norm_weight(value: torch.Tensor) -> torch.Tensor:
    """A Gemma RMSNorm's checkpoint weight w as the weight the ops multiply by: 1 + w, in fp32."""
    return 1.0 + value.float()


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in x's dtype, as transformers caps Gemma 2's logits."""
    return torch.tanh(x / cap) * cap


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, index: int):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(cfg, ops, index)
        self.mlp = MLP(cfg, ops)
        for name in NORMS:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x, residual, positions, ropes, meta):
        """x: the last layer's output (its post-feedforward norm applied), not yet in the residual."""
        ops = self.ops
        x, residual = input_norm(ops, x, residual, self.input_layernorm)
        x = self.self_attn.forward(x, positions, ropes, meta)
        x = ops.rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        norm = self.pre_feedforward_layernorm
        x, residual = ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.mlp.forward(x)
        return ops.rms_norm(x, self.post_feedforward_layernorm.weight, self.post_feedforward_layernorm.eps), residual

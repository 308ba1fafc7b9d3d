"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts,
each expert is a gated SiLU MLP, and a token's output is the sum of its experts' outputs weighted by
the router.

On CPU each expert's projections are nn.Linear layers, so they are packed for oneDNN and made
batch-invariant like every other linear (``linears.pack_linears``, ``make_invariant``). A step runs
one GEMM per projection per active expert over the tokens routed to it (gathered by a stable sort of
the routing), never a loop over tokens. With the Triton kernels (CUDA), ``fuse`` stacks the experts
into one weight per projection per layer and the step runs ``ops.fused_moe``: tokens sorted by
expert, one grouped GEMM per projection (kernels/triton/moe.py), its fixed tiles batch-invariant. What keeps a token's output independent of its batch:
- the routing is per token: softmax in fp32, then a stable descending sort, so of equal
  probabilities the lower expert index wins, whatever else the step holds (``route``);
- an expert's matmul gives each row the same bits at any row count (the invariant linears);
- a token's k outputs are summed in the order of its routing slots, not in the order the experts ran.
"""

from __future__ import annotations

import torch
from torch import nn


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), most probable first."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E], as transformers routes: in fp32
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.ops.silu_and_mul(self.gate_up_proj.forward(x)))  # [N, H]


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool, weights_in_dtype: bool, ops):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        # Qwen3-MoE casts the routing weights to the activations' dtype before it scales by them;
        # Mixtral scales in fp32 and casts the product
        self.weights_in_dtype = weights_in_dtype
        self.ops = ops
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size, ops) for _ in range(num_experts))
        self.w13 = self.w2 = None  # [E, 2I, H], [E, H, I] once fused

    def fuse(self) -> None:
        """The experts as one weight per projection, for ``ops.fused_moe``; the per-expert layers go."""
        self.w13 = torch.stack([e.gate_up_proj.weight for e in self.experts])
        self.w2 = torch.stack([e.down_proj.weight for e in self.experts])
        self.experts = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        weights, ids = route(self.gate.forward(x), self.top_k, self.normalize)  # [T, k]
        if self.weights_in_dtype:
            weights = weights.to(x.dtype)
        if self.w13 is not None:
            return self.ops.fused_moe(x, self.w13, self.w2, weights, ids)  # [T, H]
        flat = ids.flatten()  # [T * k]: slot s of token t at t * k + s
        order = torch.argsort(flat, stable=True)  # the slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one read-back a layer
        slots = x.new_empty(tokens * self.top_k, hidden)  # [T * k, H] each slot's expert output
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                picked = order[start:start + count]
                slots[picked] = expert.forward(x.index_select(0, picked // self.top_k))
                start += count
        scaled = (slots.view(tokens, self.top_k, hidden) * weights[..., None]).to(x.dtype)  # [T, k, H]
        out = scaled[:, 0]
        for slot in range(1, self.top_k):  # in slot order: the same sum for a token in any batch
            out = out + scaled[:, slot]
        return out

"""bf16 linear layers on CPU with their weights reordered for oneDNN once, at load.

F.linear on a bf16 weight makes oneDNN reorder the weight into its blocked (AMX/AVX-512) layout
on every call, which at decode batch sizes costs about as much as the matmul itself: a step's
matmuls ran 1.5x faster with the weights packed beforehand. The packed matmul runs the same
kernel and gives bit-identical outputs (checked for bf16 at batch 1..4096; not so for fp32,
which F.linear sends to MKL, so only bf16 is packed).
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """An nn.Linear sharing the original's parameters, plus a packed copy of the weight."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, batch_hint: int) -> PackedLinear:
        packed = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        packed.weight, packed.bias = linear.weight, linear.bias  # shared: ties and state stay as they were
        # an opaque oneDNN tensor; batch_hint picks the blocking, any batch size may use it
        packed.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.bfloat16 and _packing_available())


def _packing_available() -> bool:
    # private oneDNN ops: a torch build without them keeps plain nn.Linear
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available()
            and all(hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise",
                                                    "_is_mkldnn_bf16_supported"))
            and ops._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every packable nn.Linear of ``model`` in place; returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if can_pack(child)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear.from_linear(child, batch_hint))
    return len(targets)

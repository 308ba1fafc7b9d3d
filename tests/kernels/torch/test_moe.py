"""The fused mixture-of-experts twin (kernels.torch.moe) against a per-token reference and the
engine's SparseMoE, and its batch invariance."""

import pytest
import torch
import torch.nn.functional as F

from batchapi.kernels import TORCH_OPS
from batchapi.kernels.torch import moe
from batchapi.kernels.torch.elementwise import silu_and_mul


def moe_case(tokens: int, top_k: int, experts: int = 6, hidden: int = 32, inter: int = 16,
             dtype: torch.dtype = torch.float32, ragged: bool = False, seed: int = 0):
    """(x, w13, w2, topk_weights fp32, topk_ids): each token's k experts distinct; ragged: expert 0
    in every token's first slot, the last expert in none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    if ragged:
        assert top_k <= experts - 1, "ragged routing leaves the last expert out"
        rest = [1 + torch.randperm(experts - 2, generator=g)[: top_k - 1] for _ in range(tokens)]
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), r]) for r in rest]).view(tokens, top_k)
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return x, w13, w2, weights, ids


def per_token(x, w13, w2, weights, ids):
    """The op token by token, slot by slot, rounding as SparseMoE does."""
    rows = []
    for t in range(x.shape[0]):
        out = None
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            y = F.linear(silu_and_mul(F.linear(x[t : t + 1], w13[e])), w2[e])  # [1, H]
            scaled = (y * weights[t, s]).to(x.dtype)
            out = scaled if out is None else out + scaled
        rows.append(out)
    return torch.cat(rows)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("ragged", [False, True])
def test_the_twin_matches_the_per_token_reference_in_fp32(top_k, ragged):
    case = moe_case(23, top_k, ragged=ragged, seed=top_k)
    torch.testing.assert_close(moe.fused_moe(*case), per_token(*case), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("weights_in_dtype", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_the_twin_matches_the_per_token_reference_in_bf16(top_k, weights_in_dtype):
    x, w13, w2, weights, ids = moe_case(19, top_k, dtype=torch.bfloat16, ragged=True, seed=10 + top_k)
    if weights_in_dtype:
        weights = weights.bfloat16()
    out = moe.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, per_token(x, w13, w2, weights, ids), atol=2e-2, rtol=2e-2)


def _exact_case(tokens: int, top_k: int, experts: int, hidden: int, inter: int, seed: int):
    """Matmuls whose every sum is exact in bf16 (small integers in, one +-1 per row of w2), so the
    rounding of silu, the routing weights and the slot sum is all that is compared."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (tokens, hidden), generator=g).bfloat16()
    w13 = torch.randint(-1, 2, (experts, 2 * inter, hidden), generator=g).bfloat16()
    w2 = torch.zeros(experts, hidden, inter)
    w2.scatter_(2, torch.randint(0, inter, (experts, hidden, 1), generator=g),
                torch.randint(0, 2, (experts, hidden, 1), generator=g).float() * 2 - 1)
    return x, w13, w2.bfloat16()


@pytest.mark.parametrize("weights_in_dtype", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_the_twin_rounds_as_the_engines_sparse_moe(top_k, weights_in_dtype):
    from batchapi.engine.model.moe import SparseMoE, route

    experts, hidden, inter = 6, 32, 16
    x, w13, w2 = _exact_case(21, top_k, experts, hidden, inter, seed=top_k)
    layer = SparseMoE(hidden, inter, experts, top_k, normalize=True, weights_in_dtype=weights_in_dtype,
                      ops=TORCH_OPS).bfloat16()
    for e, expert in enumerate(layer.experts):
        expert.gate_up_proj.weight.data.copy_(w13[e])
        expert.down_proj.weight.data.copy_(w2[e])
    with torch.inference_mode():
        weights, ids = route(layer.gate(x), top_k, normalize=True)
        if weights_in_dtype:
            weights = weights.bfloat16()
        expected = layer(x)
        assert torch.equal(per_token(x, w13, w2, weights, ids), expected)
        assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids), expected)


def test_the_twin_is_batch_invariant_in_fp32():
    x, w13, w2, weights, ids = moe_case(65, 2, seed=3)
    probe = (x[:1], w13, w2, weights[:1], ids[:1])
    alone = moe.fused_moe(*probe)
    for n in range(1, 65):  # the probe among n - 1 other tokens, at position n // 2
        at = n // 2
        order = torch.cat([torch.arange(1, at + 1), torch.zeros(1, dtype=torch.int64), torch.arange(at + 1, n)])
        out = moe.fused_moe(x[order], w13, w2, weights[order], ids[order])
        assert torch.equal(out[at], alone[0]), f"the probe among {n} tokens"


def test_the_twin_takes_no_tokens_and_checks_its_arguments():
    x, w13, w2, weights, ids = moe_case(3, 2)
    assert moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)
    with pytest.raises(AssertionError, match="do not chain"):
        moe.fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(AssertionError, match="int64"):
        moe.fused_moe(x, w13, w2, weights, ids.int())
    with pytest.raises(AssertionError, match="topk_weights must be fp32"):
        moe.fused_moe(x, w13, w2, weights.double(), ids)

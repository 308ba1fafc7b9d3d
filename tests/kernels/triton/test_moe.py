"""The Triton fused mixture-of-experts kernel (kernels.triton.moe, interpreted on CPU) against its
twin, over ragged expert segments, and its batch invariance."""

import pytest
import torch
from triton.runtime import interpreter

from batchapi.kernels import get_ops
from batchapi.kernels.torch import moe as twin
from batchapi.kernels.triton import moe
from tests.kernels.torch.test_moe import moe_case

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _ragged_ids(tokens: int, top_k: int) -> torch.Tensor:
    """Expert 0 in every token's first slot (more than BLOCK_M rows at BLOCK_M + 6 tokens), expert 3
    in none, experts 1 and 2 alternating in the second slot: segments of T, ceil(T/2), floor(T/2), 0."""
    first = torch.zeros(tokens, 1, dtype=torch.int64)
    if top_k == 1:
        return first
    second = 1 + torch.arange(tokens)[:, None] % 2
    return torch.cat([first, second], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_ragged_segments_match_the_twin(top_k, dtype):
    tokens = moe.BLOCK_M + 6
    x, w13, w2, weights, _ = moe_case(tokens, top_k, experts=4, dtype=dtype, seed=top_k)
    ids = _ragged_ids(tokens, top_k)
    out = moe.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, twin.fused_moe(x, w13, w2, weights, ids), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 7, 20])
def test_random_routing_matches_the_twin(tokens, top_k):
    x, w13, w2, weights, ids = moe_case(tokens, top_k, experts=4, seed=tokens + top_k)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids), twin.fused_moe(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_weights_in_the_activations_dtype_match_the_twin():
    x, w13, w2, weights, ids = moe_case(9, 2, experts=4, dtype=torch.float16, seed=5)
    weights = weights.half()
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids), twin.fused_moe(x, w13, w2, weights, ids),
                               atol=2e-3, rtol=2e-3)


def test_the_alignment_pads_each_segment_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])
    sorted_ids, block_experts, num_padded = moe.align_block_size(ids, 4, 4)
    # slots by expert: 0 -> [1, 5], 1 -> [3], 2 -> [0, 2, 4], 3 -> none; padding is 6 (the slot count)
    assert sorted_ids.tolist()[:12] == [1, 5, 6, 6, 3, 6, 6, 6, 0, 2, 4, 6]
    assert int(num_padded) == 12 and block_experts.tolist()[:3] == [0, 1, 2]
    assert set(sorted_ids.tolist()[12:]) <= {6} and sorted_ids.numel() % 4 == 0


@pytest.fixture
def dot_in_k_order(monkeypatch):
    """The interpreter's tl.dot is numpy's matmul, whose BLAS gives a row other bits by its position
    in the tile, which a GPU's MMA does not (tests/kernels/triton/test_invariance.py): sum in k order."""
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.copy()
        x, y = a.data.astype(acc.dtype), b.data.astype(acc.dtype)
        for k in range(x.shape[-1]):
            acc += x[..., :, k : k + 1] * y[..., k : k + 1, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def test_a_token_gets_the_same_bits_alone_and_in_a_batch(dot_in_k_order):
    x, w13, w2, weights, ids = moe_case(20, 2, experts=4, seed=7)
    alone = moe.fused_moe(x[:1], w13, w2, weights[:1], ids[:1])
    for n, at in ((2, 1), (7, 3), (20, 19)):
        order = torch.cat([torch.arange(1, at + 1), torch.zeros(1, dtype=torch.int64), torch.arange(at + 1, n)])
        out = moe.fused_moe(x[order], w13, w2, weights[order], ids[order])
        assert torch.equal(out[at], alone[0]), f"the probe among {n} tokens"


def test_the_launcher_checks_and_the_triton_set_has_the_kernel():
    assert get_ops("triton", "cpu").fused_moe is moe.fused_moe
    x, w13, w2, weights, ids = moe_case(3, 2, experts=4)
    assert moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)
    with pytest.raises(AssertionError, match="do not chain"):
        moe.fused_moe(x, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(AssertionError, match="contiguous"):
        moe.fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)

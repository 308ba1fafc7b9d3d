"""The Triton token bitmask kernel (kernels.triton.bitmask, interpreted on CPU) against its twin, bit
for bit. bf16 runs here too: the interpreter has no bf16 arithmetic, but the kernel does none on
the logits, it only stores -inf."""

import pytest
import torch

from batchapi.kernels import TORCH_OPS
from batchapi.kernels.triton import bitmask

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "vocab", "words", "rows"), [
    (5, 2100, 66, [4, 0, 2]),  # three token blocks, the last ragged; vocab not a multiple of 32
    (3, 64, 5, [1]),  # a bitmask wider than the vocabulary
    (2, 1024, 32, [0, 1]),  # one whole block
])
def test_apply_token_bitmask_matches_twin(batch, vocab, words, rows, dtype):
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(batch, vocab + 8, generator=g).to(dtype)
    wide[:, ::9] = float("-inf")
    wide[:, 4::11] = -0.0
    mask = torch.randint(-2**31, 2**31, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[:, 0], mask[:, -1] = 0, -1
    logits, twin = wide[:, :vocab], wide.clone()  # rows a step longer than the vocabulary
    bitmask.apply_token_bitmask(logits, mask, rows)
    TORCH_OPS.apply_token_bitmask(twin[:, :vocab], mask, rows)
    assert torch.equal(wide.view(BITS[dtype]), twin.view(BITS[dtype]))


def test_a_row_outside_the_logits_is_refused():
    logits = torch.zeros(2, 64)
    with pytest.raises(IndexError, match=r"rows \[2\] lie outside"):
        bitmask.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), [2])
    assert not logits.isinf().any()

"""The token bitmask twin (kernels.torch.bitmask) against a bit-by-bit reading of the mask."""

import pytest
import torch

from batchapi.kernels.torch.bitmask import apply_token_bitmask


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of float tensors: equal only if bit-identical (-0.0 is not 0.0)."""
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype])


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool: bit v % 32 of word v // 32, read one token at a time."""
    words = bitmask.long() & 0xFFFFFFFF
    v = torch.arange(vocab)
    return (words[:, v // 32] >> (v % 32)) & 1 == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "vocab", "words"), [(6, 100, 4), (6, 100, 9), (3, 64, 2), (5, 1, 1)])
def test_disallowed_tokens_become_minus_inf_and_the_rest_keep_their_bits(dtype, batch, vocab, words):
    g = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    logits[:, ::5] = -0.0
    logits[:, 1::7] = float("-inf")
    rows = [batch - 1, 0, 2] if batch > 3 else [2, 0]
    bitmask = torch.randint(-2**31, 2**31, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0], bitmask[-1, -1] = 0, -1  # a word of zeros, a word of ones
    before = logits.clone()
    apply_token_bitmask(logits, bitmask, rows)
    keep = allowed(bitmask, vocab)
    for i in range(batch):
        if i not in rows:
            assert torch.equal(bits(logits[i]), bits(before[i]))
            continue
        k = rows.index(i)
        assert torch.equal(bits(logits[i][keep[k]]), bits(before[i][keep[k]]))
        assert torch.isneginf(logits[i][~keep[k]]).all()


def test_no_rows_leave_the_logits_alone():
    logits = torch.randn(2, 40)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32), [])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("bad", [-1, 3])
def test_a_row_outside_the_logits_is_refused_before_anything_is_written(bad):
    logits = torch.zeros(3, 40)
    with pytest.raises(IndexError, match=rf"rows \[{bad}\] lie outside the logits' 3 rows"):
        apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), [0, bad])
    assert not logits.isinf().any()

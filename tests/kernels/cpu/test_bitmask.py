"""The C token bitmask (kernels.cpu.elementwise.apply_token_bitmask, csrc/elementwise.c) against its
twin (kernels.torch.bitmask): bit for bit the same logits."""

from types import SimpleNamespace

import pytest
import torch

from batchapi.kernels.cpu import build, elementwise
from batchapi.kernels.torch import bitmask as twin_bitmask
from tests.kernels.march import PORTABLE, load_portable_elementwise

DTYPES = [torch.float32, torch.bfloat16]
# (batch, vocab, words): vocab a multiple of 32 or not, words just covering it or more
SHAPES = [(9, 49157, 1537), (9, 4096, 128), (4, 100, 4), (4, 100, 12), (3, 31, 1), (2, 1, 1)]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert build.load_elementwise() is not None, "the test machine has a C compiler: the kernels must build"


@pytest.fixture
def c_only(monkeypatch):
    """A fall-back to the twin fails the test (the oracle, twin_bitmask's, stays the real one)."""
    monkeypatch.setattr(elementwise, "twin_bitmask", SimpleNamespace(
        apply_token_bitmask=lambda *a: pytest.fail("apply_token_bitmask went to the twin"),
        check_rows=twin_bitmask.check_rows))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype])


def case(batch, vocab, words, dtype, rows, seed=0):
    """Logits with -inf and -0.0 among them, and a bitmask of random words, words of zeros (few
    tokens allowed), words of ones (all allowed) and words with one bit set or one bit clear."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    logits[:, ::13] = float("-inf")
    logits[:, 5::17] = -0.0
    logits[:, 6::19] = 0.0
    bitmask = torch.randint(-2**31, 2**31, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    kind = torch.randint(0, 5, (len(rows), words), generator=g)
    one_bit = torch.tensor(1, dtype=torch.int32) << torch.randint(0, 32, (len(rows), words), generator=g).int()
    bitmask = torch.where(kind == 0, 0, torch.where(kind == 1, -1, bitmask))
    bitmask = torch.where(kind == 2, one_bit, torch.where(kind == 3, ~one_bit, bitmask)).to(torch.int32)
    return logits, bitmask.contiguous()


def assert_same(c: torch.Tensor, twin: torch.Tensor) -> None:
    assert torch.equal(bits(c), bits(twin)), f"{int((bits(c) != bits(twin)).sum())} elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "vocab", "words"), SHAPES)
def test_c_matches_the_twin_bit_for_bit(batch, vocab, words, dtype, c_only):
    for rows in ([*range(batch)], [batch - 1, 0], [batch // 2]):  # all rows, a subset out of order, one
        logits, bitmask = case(batch, vocab, words, dtype, rows, seed=len(rows))
        twin = logits.clone()
        elementwise.apply_token_bitmask(logits, bitmask, rows)
        twin_bitmask.apply_token_bitmask(twin, bitmask, rows)
        assert_same(logits, twin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_and_all_one_masks(dtype, c_only):
    logits, _ = case(3, 1000, 40, dtype, [0, 1, 2])
    before = logits.clone()
    bitmask = torch.zeros(3, 40, dtype=torch.int32)
    bitmask[1] = -1
    elementwise.apply_token_bitmask(logits, bitmask, [0, 1, 2])
    assert torch.isneginf(logits[[0, 2]]).all()
    assert_same(logits[1], before[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_a_step_apart_and_a_repeated_row(dtype, c_only):
    """Logits rows with a step longer than the vocabulary (a column slice), the same row listed
    twice (both masks apply: the twin adds both biases)."""
    wide, bitmask = case(5, 300 + 40, 10, dtype, [3, 1, 3])
    logits, twin = wide[:, 8:308], wide.clone()[:, 8:308]
    elementwise.apply_token_bitmask(logits, bitmask, [3, 1, 3])
    twin_bitmask.apply_token_bitmask(twin, bitmask, [3, 1, 3])
    assert_same(wide[:, 8:308], twin)
    assert_same(wide[:, :8], case(5, 340, 10, dtype, [3, 1, 3])[0][:, :8])  # the columns beside untouched


def test_threads_split_rows_without_changing_them():
    logits, bitmask = case(64, 49152, 1536, torch.bfloat16, list(range(64)))
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = logits.clone()
            elementwise.apply_token_bitmask(out, bitmask, list(range(64)))
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert_same(*outs)


@pytest.mark.parametrize("bad", [-1, 4])
def test_a_row_outside_the_logits_is_refused_before_anything_is_written(bad, c_only):
    logits = torch.zeros(4, 64)
    with pytest.raises(IndexError, match=rf"rows \[{bad}\] lie outside the logits' 4 rows"):
        elementwise.apply_token_bitmask(logits, torch.zeros(3, 2, dtype=torch.int32), [0, bad, 1])
    assert not logits.isinf().any()


class _Untouchable:
    def __getattr__(self, name):
        pytest.fail(f"{name} was called in C")


def test_what_c_does_not_take_goes_to_the_twin(monkeypatch):
    monkeypatch.setattr(elementwise, "load_elementwise", _Untouchable)
    _, bitmask = case(3, 100, 4, torch.float32, [2, 0])
    for logits in (case(3, 100, 4, torch.float16, [2, 0])[0],  # fp16
                   case(100, 3, 4, torch.float32, [2, 0])[0].t()):  # a column stride
        twin = logits.clone()
        elementwise.apply_token_bitmask(logits, bitmask, [2, 0])
        twin_bitmask.apply_token_bitmask(twin, bitmask, [2, 0])
        assert_same(logits, twin)
    with pytest.raises(AssertionError, match="contiguous int32"):  # the twin's refusal
        elementwise.apply_token_bitmask(torch.zeros(3, 64), torch.zeros(2, 4, dtype=torch.int32)[:, ::2], [0, 1])
    with pytest.raises(AssertionError, match="cannot cover"):
        elementwise.apply_token_bitmask(torch.zeros(3, 100), torch.zeros(2, 3, dtype=torch.int32), [0, 1])


def test_without_the_library_it_is_the_twin(monkeypatch):
    monkeypatch.setattr(elementwise, "load_elementwise", lambda: None)  # as where the library did not build
    logits, bitmask = case(4, 100, 4, torch.bfloat16, [1, 3])
    twin = logits.clone()
    elementwise.apply_token_bitmask(logits, bitmask, [1, 3])
    twin_bitmask.apply_token_bitmask(twin, bitmask, [1, 3])
    assert_same(logits, twin)


@pytest.mark.parametrize(("march", "needs"), PORTABLE)
def test_the_portable_c_matches_the_twin_too(march, needs, tmp_path, monkeypatch):
    """The loops for CPUs without AVX-512, built here for x86 CPUs that lack it."""
    if not load_portable_elementwise(march, needs, tmp_path, monkeypatch):
        return  # a CPU without them: built, not run
    for dtype in DTYPES:
        for batch, vocab, words in SHAPES:
            rows = [batch - 1, 0]
            logits, bitmask = case(batch, vocab, words, dtype, rows, seed=vocab)
            twin = logits.clone()
            elementwise.apply_token_bitmask(logits, bitmask, rows)
            twin_bitmask.apply_token_bitmask(twin, bitmask, rows)
            assert_same(logits, twin)

"""The CPU attention path's routing: which query rows the C kernel takes, and that it is right."""

import pytest
import torch

from batchapi.kernels import attention_cpu, attention_ref, native
from tests.kernels.paged import dense_attention, make_case

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native.load() is not None, "the test machine has a C compiler: the kernel must build"


@pytest.fixture
def routed(monkeypatch):
    """(rows the C kernel gets per call, prefill runs the twin gets), counted per layer call."""
    calls, twin = [], []
    real_c, real_twin = native.paged_decode, attention_ref._prefill_one
    monkeypatch.setattr(native, "paged_decode", lambda *a, **k: calls.append(a[6].numel()) or real_c(*a, **k))
    monkeypatch.setattr(attention_ref, "_prefill_one", lambda q, *a: twin.append(q.shape[0]) or real_twin(q, *a))
    monkeypatch.setattr(attention_ref, "_decode", lambda *a, **k: pytest.fail("decode rows went to the twin"))
    return calls, twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_prefills_run_in_c_as_rows_with_causal_contexts(dtype, routed):
    # decode rows; a whole prompt; a chunk on a cached prefix; a run of exactly the limit; one
    # token past it (the twin's); one-token contexts
    limit = attention_cpu.PREFILL_ROWS_IN_C
    q_lens = [1, 20, 1, 7, limit, limit + 1, 1]
    ctx_lens = [50, 20, 1, 40, limit + 3, limit + 30, 129]
    case = make_case(q_lens, ctx_lens, 6, 2, 64, dtype=dtype, seed=3)
    out = attention_cpu.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    calls, twin = routed
    assert calls == [3 + 20 + 7 + limit] and twin == [limit + 1]


def test_a_step_of_prefills_alone_runs_in_c(routed):
    case = make_case([3, 16, 2], [3, 33, 18], 4, 4, 32, block_size=8, seed=4)
    out = attention_cpu.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert routed == ([21], [])


def test_a_prefill_row_past_the_pool_is_refused(routed):
    case = make_case([5, 1], [40, 9], 4, 2, 32, seed=6)
    case.block_tables[0, 2] = case.k_cache.shape[0]  # the prefill's third block: outside the pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        attention_cpu.paged_attention(*case.args(), case.scale)

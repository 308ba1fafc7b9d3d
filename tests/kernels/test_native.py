"""The C decode attention (kernels/native.py, csrc/paged_decode.c) against dense attention and the twin."""

import random

import pytest
import torch

from batchapi.kernels import CPU_OPS, TORCH_OPS, attention_cpu, attention_ref, get_ops, native
from tests.kernels.paged import dense_attention, make_case

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native.load() is not None, "the test machine has a C compiler: the kernel must build"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_decode_matches_dense(seed, dtype):
    rng = random.Random(seed)
    hkv, group = rng.choice([(1, 1), (3, 3), (2, 4), (1, 8), (4, 2), (1, 16)])
    d = rng.choice([64, 128, 32, 36])  # 36: not a multiple of the vector width, the plain loops
    block_size = rng.choice([8, 16, 32])
    ctx_lens = [rng.choice([1, block_size, block_size + 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 9))]
    case = make_case([1] * len(ctx_lens), ctx_lens, hkv * group, hkv, d, block_size=block_size, dtype=dtype,
                     seed=seed)
    out = attention_cpu.paged_attention(*case.args(), case.scale)
    assert not out.isnan().any(), "a block no sequence owns (NaN) was read"
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_decode_in_c_prefill_in_the_twin(dtype):
    # decode rows, a whole prompt, a chunk on a cached prefix: one step, as the engine sends it
    q_lens, ctx_lens = [1, 20, 1, 7, 1], [50, 20, 1, 40, 129]
    case = make_case(q_lens, ctx_lens, 6, 2, 64, dtype=dtype, seed=3)
    out = attention_cpu.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    twin = attention_ref.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, twin, atol=TOL[dtype], rtol=TOL[dtype])


def test_long_context_with_large_logits_and_huge_block_ids():
    # scores spanning hundreds: the online softmax rescales many times and must not overflow;
    # block ids near 2^31 / (block elements) push element offsets past int32
    case = make_case([1, 1, 1], [1500, 977, 3], 4, 2, 64, seed=5, num_blocks=2_200_000)
    case.q.mul_(40.0)
    out = attention_cpu.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=1e-4, rtol=1e-4)


def test_threads_split_the_work_without_changing_it():
    case = make_case([1] * 24, [random.Random(i).randint(1, 200) for i in range(24)], 9, 3, 64, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention_cpu.paged_attention(*case.args(), case.scale)
        torch.set_num_threads(2)
        two = attention_cpu.paged_attention(*case.args(), case.scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (sequence, head) is one task: no cross-thread sums


def test_fp16_and_over_wide_groups_go_to_the_twin_whole():
    case = make_case([1, 3], [10, 30], 4, 1, 64, dtype=torch.float16, seed=2)
    assert not native.supports(case.q, case.k_cache)
    out = attention_cpu.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=2e-3, rtol=2e-3)
    wide = make_case([1], [10], 32, 1, 64, seed=2)  # 32 query heads on one kv head: over 16
    assert not native.supports(wide.q, wide.k_cache)
    torch.testing.assert_close(attention_cpu.paged_attention(*wide.args(), wide.scale), dense_attention(wide),
                               atol=2e-5, rtol=2e-5)


def test_launcher_refuses_wrong_dtypes_and_strides():
    case = make_case([1, 1], [10, 20], 4, 2, 64, seed=1)
    out = torch.empty_like(case.q)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(AssertionError, match="seq_ids must be a contiguous CPU torch.int32"):
        native.paged_decode(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                            case.context_lens, ids.long(), out, case.scale)
    with pytest.raises(AssertionError, match="block_tables must be"):
        native.paged_decode(case.q, case.k_cache, case.v_cache, case.block_tables.t().contiguous().t(),
                            case.cu_seqlens_q, case.context_lens, ids, out, case.scale)


def test_auto_picks_the_c_kernel_on_cpu_and_torch_stays_pure():
    assert get_ops("auto", "cpu") is CPU_OPS
    assert get_ops("cpu", "cpu") is CPU_OPS
    assert get_ops("torch", "cpu") is TORCH_OPS
    assert CPU_OPS.paged_attention is attention_cpu.paged_attention


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path))
    lib = native._load()
    assert lib is not None
    built = list(tmp_path.glob("paged_decode-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert native._load() is not None
    assert built[0].stat().st_mtime_ns == mtime, "a second load rebuilt the library"
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name], "a temporary file was left behind"


def test_without_a_compiler_auto_falls_back_to_the_twins(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "_state", {})
    assert native.load() is None
    assert "building paged_decode.c failed" in caplog.text
    assert get_ops("auto", "cpu") is TORCH_OPS
    with pytest.raises(AssertionError, match="kernel mode cpu needs a C compiler"):
        get_ops("cpu", "cpu")
    case = make_case([1, 5], [9, 5], 4, 2, 64, seed=4)
    out = attention_cpu.paged_attention(*case.args(), case.scale)  # the twin, whole
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=2e-5)


def test_a_broken_compiler_output_is_reported_not_raised(tmp_path, monkeypatch, caplog):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error: unsupported option' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BATCHAPI_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    assert native._load() is None
    assert "unsupported option" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


@pytest.mark.parametrize("bad", [-1, 10_000])
def test_a_bad_block_id_is_refused_before_the_kernel_reads_it(bad):
    case = make_case([1, 1], [40, 20], 4, 2, 64, seed=6)
    tables = case.block_tables.clone()
    tables[0, 1] = bad  # inside sequence 0's context (blocks 0..2)
    with pytest.raises(AssertionError, match="outside the KV pool"):
        attention_cpu.paged_attention(case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q,
                                      case.context_lens, case.scale)
    tables = case.block_tables.clone()
    tables[1, 2:] = bad  # past sequence 1's context (two blocks): padding, never read
    out = attention_cpu.paged_attention(case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q,
                                        case.context_lens, case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=2e-5)


def test_a_decreasing_cu_seqlens_is_refused():
    case = make_case([1, 1], [4, 5], 4, 2, 64, seed=6)
    with pytest.raises(AssertionError, match="never decrease"):
        attention_cpu.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                      torch.tensor([0, 2, 1], dtype=torch.int32), case.context_lens, case.scale)

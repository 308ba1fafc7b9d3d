"""The C paged attention (kernels.cpu.attention, csrc/paged_decode.c) against dense attention and the twin."""

import random
import subprocess

import pytest
import torch

from batchapi.kernels.cpu import attention, build
from batchapi.kernels.torch import attention as twin
from tests.kernels.march import build_for
from tests.kernels.paged import dense_attention, make_case

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert build.load() is not None, "the test machine has a C compiler: the kernel must build"


@pytest.fixture
def c_only(monkeypatch):
    """Decode rows must go to the C kernel: the twin's own decode path fails the test, and the
    calls into C are counted."""
    calls = []
    real = attention._decode_rows
    monkeypatch.setattr(attention, "_decode_rows", lambda plan, *a: calls.append(plan.rows.numel()) or real(plan, *a))
    monkeypatch.setattr(twin, "_decode", lambda *a, **k: pytest.fail("decode rows went to the twin"))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_decode_matches_dense(seed, dtype, c_only):
    rng = random.Random(seed)
    hkv, group = rng.choice([(1, 1), (3, 3), (2, 4), (1, 8), (4, 2), (1, 16)])
    d = rng.choice([64, 128, 32, 36])  # 36: not a multiple of the vector width, the plain loops
    block_size = rng.choice([8, 16, 32])
    ctx_lens = [rng.choice([1, block_size, block_size + 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 9))]
    case = make_case([1] * len(ctx_lens), ctx_lens, hkv * group, hkv, d, block_size=block_size, dtype=dtype,
                     seed=seed)
    out = attention.paged_attention(*case.args(), case.scale)
    assert not out.isnan().any(), "a block no sequence owns (NaN) was read"
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    assert c_only == [len(ctx_lens)]


# the edges the random draws may miss: the widest group, head sizes that are a multiple of 8 but
# not of 16 (the vector loop's half tail), the largest head and the largest block the kernel takes
@pytest.mark.parametrize(("hkv", "group", "d", "block_size"),
                         [(1, 16, 64, 16), (2, 4, 24, 16), (1, 2, 40, 8), (2, 3, 72, 32), (1, 4, 256, 32),
                          (2, 2, 8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_edges_match_dense(hkv, group, d, block_size, dtype, c_only):
    ctx_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 97]
    case = make_case([1] * 5, ctx_lens, hkv * group, hkv, d, block_size=block_size, dtype=dtype, seed=d)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    assert c_only == [5]


# the vector path takes 16 tokens of a block at a time and specialises on head sizes 64 and 128:
# blocks just under, at and over 16 tokens, and head sizes beside the specialised ones
@pytest.mark.parametrize(("d", "block_size"), [(64, 15), (64, 16), (64, 17), (64, 32), (48, 16), (80, 16),
                                               (128, 16), (128, 32), (80, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_16_at_their_edges_match_dense(d, block_size, dtype, c_only):
    ctx_lens = [1, 15, 16, 17, 31, 32, 33, block_size - 1, block_size + 1, 2 * block_size, 100]
    case = make_case([1] * len(ctx_lens), ctx_lens, 9, 3, d, block_size=block_size, dtype=dtype, seed=d + block_size)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    assert c_only == [len(ctx_lens)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_past_the_context_in_its_last_block_are_not_read(dtype, c_only):
    # the tail of a sequence's last block is its own memory but holds no token yet: stale or NaN
    ctx_lens = [1, 5, 17, 30, 40]
    case = make_case([1] * 5, ctx_lens, 4, 2, 64, block_size=32, dtype=dtype, seed=11)
    for b, n in enumerate(ctx_lens):
        last = int(case.block_tables[b, (n - 1) // 32])
        case.k_cache[last, (n - 1) % 32 + 1:] = float("nan")
        case.v_cache[last, (n - 1) % 32 + 1:] = float("nan")
    out = attention.paged_attention(*case.args(), case.scale)
    assert not out.isnan().any(), "a row past the context was read"
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    assert c_only == [5]


@pytest.mark.parametrize("step", [0.05, 0.4, 0.7])
def test_a_maximum_that_keeps_rising_matches_dense(step, c_only):
    # each key's score `step` over the one before: the running maximum moves in every block of 16,
    # by less or by more than the kernel lets it drift before it rescales (8)
    ctx_lens = [300, 77]
    case = make_case([1, 1], ctx_lens, 4, 1, 64, block_size=16, seed=12)
    for b, n in enumerate(ctx_lens):
        q = case.q[b, 0]
        keys = case.keys[b]  # [ctx, 1, D]
        keys[:, 0] = keys[:, 0] * 0.1 + torch.arange(n, dtype=torch.float32)[:, None] * step / (q @ q * case.scale) * q
        for t in range(n):
            case.k_cache[int(case.block_tables[b, t // 16]), t % 16, 0] = keys[t, 0]
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=1e-4, rtol=1e-4)
    assert c_only == [2]


# the kernel has an AVX-512 path (with dpbf16 where the CPU has AVX512_BF16), an AVX2 one and plain
# C: those the -march=native build of the other tests may not take (on a CPU with AMX, its bf16 rows
# run on the tiles), built here for a CPU that has them and checked against dense attention
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(("march", "needs"), [("x86-64", {"sse2"}), ("haswell", {"avx2", "fma"}),
                                              ("skylake-avx512", AVX512),
                                              ("cooperlake", AVX512 | {"avx512_bf16"})])
def test_every_vector_path_matches_dense(march, needs, tmp_path, monkeypatch):
    if not build_for(march, needs, build.SOURCE, tmp_path, monkeypatch):
        return  # a CPU without them: built, not run
    lib = build._load()
    assert lib is not None
    monkeypatch.setattr(build, "load", lambda: lib)
    shapes = [(3, 3, 64, 16), (1, 16, 128, 32), (2, 4, 36, 17), (1, 1, 256, 1), (4, 2, 8, 15), (2, 3, 80, 8)]
    for seed, (hkv, group, d, block_size) in enumerate(shapes):
        ctx_lens = [1, block_size, block_size + 1, 16, 17, 50, 97]
        for dtype in (torch.float32, torch.bfloat16):
            case = make_case([1] * len(ctx_lens), ctx_lens, hkv * group, hkv, d, block_size=block_size, dtype=dtype,
                             seed=seed)
            out = attention.paged_attention(*case.args(), case.scale)
            assert not out.isnan().any(), "a block no sequence owns (NaN) was read"
            torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
            # a window that starts mid-block, freed blocks before it, a soft cap; decode and prefill rows
            case = make_case([1] * len(ctx_lens) + [9], ctx_lens + [60], hkv * group, hkv, d, block_size=block_size,
                             dtype=dtype, seed=seed, window=21, freed="nan")
            case.q.mul_(10.0)
            out = attention.paged_attention(*case.args(), case.scale, window=21, softcap=30.0)
            assert not out.isnan().any(), "a freed block was read"
            torch.testing.assert_close(out, dense_attention(case, softcap=30.0), atol=2 * TOL[dtype],
                                       rtol=2 * TOL[dtype])


def on_tiles_and_on_vectors(call):
    """``call()`` with bf16 decode on AMX tiles (where this build and the OS have them) and kept on
    the vector units."""
    lib = build.load()
    try:
        lib.paged_decode_set_amx(1)
        tiles = call()
        lib.paged_decode_set_amx(0)
        return tiles, call()
    finally:
        lib.paged_decode_set_amx(1)


@pytest.mark.parametrize(("hkv", "group", "d", "block_size"),
                         [(3, 3, 64, 16), (1, 16, 128, 32), (2, 4, 96, 17), (1, 1, 256, 8), (2, 7, 64, 16)])
def test_bf16_decode_on_tiles_and_on_vectors_both_match_dense(hkv, group, d, block_size, c_only):
    # chunks of 16 in pairs on the tiles: contexts that end in each half of a pair, a window that
    # starts mid-chunk with NaN blocks before it, a soft cap; probabilities rounded to bf16 there
    ctx_lens = [1, 15, 16, 17, 31, 32, 33, 50, 97, 300]
    for window, softcap in [(0, 0.0), (21, 30.0)]:
        case = make_case([1] * len(ctx_lens), ctx_lens, hkv * group, hkv, d, block_size=block_size,
                         dtype=torch.bfloat16, seed=d + group, window=window, freed="nan" if window else "")
        if softcap:
            case.q.mul_(10.0)
        expected = dense_attention(case, softcap=softcap)
        tiles, vectors = on_tiles_and_on_vectors(
            lambda case=case, window=window, softcap=softcap: attention.paged_attention(
                *case.args(), case.scale, window=window, softcap=softcap))
        for out in (tiles, vectors):
            assert not out.isnan().any(), "a row past the context, or a freed block, was read"
            torch.testing.assert_close(out, expected, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
        if build.load().paged_decode_amx():  # the tiles ran: their rounding of the probabilities shows
            assert not torch.equal(tiles, vectors)
        else:
            assert torch.equal(tiles, vectors)  # no tiles here: the vector units both times


def test_a_row_on_the_tiles_is_the_same_whatever_the_batch(c_only):
    # each (sequence, kv head) alone on the tiles: its bits are those it has on its own
    ctx_lens = [random.Random(i).randint(1, 300) for i in range(12)]
    case = make_case([1] * 12, ctx_lens, 9, 3, 64, dtype=torch.bfloat16, seed=4)
    together = attention.paged_attention(*case.args(), case.scale)
    for i in (0, 5, 11):
        alone = make_case([1], [ctx_lens[i]], 9, 3, 64, dtype=torch.bfloat16, seed=4)
        alone.q.copy_(case.q[i:i + 1])
        for b in range((ctx_lens[i] + 15) // 16):
            src, dst = int(case.block_tables[i, b]), int(alone.block_tables[0, b])
            alone.k_cache[dst].copy_(case.k_cache[src])
            alone.v_cache[dst].copy_(case.v_cache[src])
        assert torch.equal(attention.paged_attention(*alone.args(), alone.scale), together[i:i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_decode_and_short_prefills_in_c(dtype, c_only):
    # decode rows, a whole prompt, a chunk on a cached prefix: one step, as the engine sends it;
    # the prefills' tokens go to C as rows of their own (routing: the end of this file)
    q_lens, ctx_lens = [1, 20, 1, 7, 1], [50, 20, 1, 40, 129]
    case = make_case(q_lens, ctx_lens, 6, 2, 64, dtype=dtype, seed=3)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    assert c_only == [3 + 20 + 7]


def test_long_context_with_large_logits(c_only):
    # scores spanning hundreds: the online softmax rescales many times and must not overflow
    case = make_case([1, 1, 1], [1500, 977, 3], 4, 2, 64, seed=5)
    case.q.mul_(40.0)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=1e-4, rtol=1e-4)
    assert c_only == [3]


def test_block_ids_whose_element_offsets_pass_int32(c_only):
    # 1.1M blocks of 16 x 1 x 128 elements: the top ids start past 2^31 elements (2.3 GB in bf16,
    # left untouched but for the blocks the sequences own)
    case = make_case([1, 1, 1], [40, 17, 3], 4, 1, 128, dtype=torch.bfloat16, seed=8, num_blocks=1_100_000)
    assert int(case.block_tables.max()) * 16 * 128 > 2**31
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert c_only == [3]


def on_one_thread_and_on(threads: int, call):
    """call() on one thread, then on `threads`; torch's thread count as it was after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(threads)
        return one, call()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("seqs", "hkv", "threads"), [(24, 3, 2), (24, 3, 3), (24, 3, 7), (1, 1, 4), (2, 2, 5)])
def test_threads_split_the_work_without_changing_it(seqs, hkv, threads, c_only):
    # each thread takes a contiguous share of the (sequence, kv head) tasks, weighed by their keys:
    # every task run once, by one thread, whatever the team (more threads than tasks included)
    case = make_case([1] * seqs, [random.Random(i).randint(1, 200) for i in range(seqs)], 3 * hkv, hkv, 64, seed=9)
    one, many = on_one_thread_and_on(threads, lambda: attention.paged_attention(*case.args(), case.scale))
    assert torch.equal(one, many)  # each (sequence, head) is one task: no cross-thread sums
    torch.testing.assert_close(many, dense_attention(case), atol=1e-4, rtol=1e-4)
    assert c_only == [seqs, seqs]


# the shares themselves, in C: a task run twice writes the same bits, which no output shows
SHARES = r"""
#include SOURCE
#include <stdio.h>
static unsigned long long state = 88172645463325252ull;
static unsigned next(void) { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return (unsigned)state; }
int main(void) {
    static int32_t lens[64], ids[64];
    static int taken[64 * 8];
    long bad = 0;
    for (int run = 0; run < 4000; run++) {
        const int seqs = run % 9 == 0 ? 0 : (int)(next() % 40), hkv = 1 + (int)(next() % 8);
        const int window = next() % 3 == 0 ? (int)(next() % 40) : 0, team = 1 + (int)(next() % 12);
        for (int i = 0; i < seqs; i++) {
            const int kind = (int)(next() % 5);
            lens[i] = kind == 0 ? 0 : kind == 1 ? -(int)(next() % 1000) : kind == 2 ? 2147483647 - (int)(next() % 64)
                                                                               : (int)(next() % 500);
            ids[i] = (int)(next() % (unsigned)seqs);
        }
        const int64_t tasks = (int64_t)seqs * hkv;
        for (int64_t t = 0; t < tasks; t++) taken[t] = 0;
#pragma omp parallel num_threads(team)
        {
            int64_t first, last;
            task_share(ids, seqs, hkv, lens, window, &first, &last);
            for (int64_t t = first; t < last; t++) {
#pragma omp atomic
                taken[t]++;
            }
        }
        for (int64_t t = 0; t < tasks; t++) bad += taken[t] != 1;
    }
    printf("bad %ld\n", bad);
    return 0;
}
"""


def test_the_threads_shares_take_every_task_once(tmp_path):
    # every (sequence, kv head) task taken by exactly one thread, whatever the team, the windows and
    # the lengths (0, negative, near 2^31: a task's work summed in int64)
    compiler = build._compiler()
    assert compiler is not None
    program = tmp_path / "shares.c"
    program.write_text(SHARES.replace("#include SOURCE", f'#include "{build.SOURCE}"'))
    flags = [f for f in build.CFLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([compiler, *flags, "-o", str(tmp_path / "shares"), str(program), "-lm"], check=True,
                   capture_output=True, timeout=120)
    out = subprocess.run([str(tmp_path / "shares")], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "bad 0"


@pytest.mark.parametrize("threads", [3, 5])
def test_threads_split_windowed_rows_and_prefill_rows_without_changing_them(threads):
    # the shares weigh each task by the keys of its window; prefill rows (each token its own row,
    # its sequence's table) among decode rows, every token in C (invariant)
    case = windowed_case(21, 0.0, torch.float32, "nan", 16)
    one, many = on_one_thread_and_on(threads, lambda: attention.paged_attention(*case.args(), case.scale, True,
                                                                                 window=21))
    assert torch.equal(one, many)
    torch.testing.assert_close(many, dense_attention(case), atol=2 * TOL[torch.float32], rtol=2 * TOL[torch.float32])


@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "dtype"), [
    (4, 1, 64, 16, torch.float16),  # no fp16 in the kernel
    (32, 1, 64, 16, torch.float32),  # 32 query heads on one kv head: over 16
    (4, 2, 64, 64, torch.float32),  # blocks over 32 tokens
    (4, 2, 64, 128, torch.bfloat16),
    (2, 1, 320, 16, torch.float32),  # heads over 256
])
def test_what_the_kernel_does_not_take_goes_to_the_twin_whole(hq, hkv, d, block_size, dtype, monkeypatch):
    monkeypatch.setattr(attention, "_decode_rows", lambda *a, **k: pytest.fail("sent to the C kernel"))
    case = make_case([1, 3, 1], [10, 30, 70], hq, hkv, d, block_size=block_size, dtype=dtype, seed=2)
    assert not attention.supports(case.q, case.k_cache, case.v_cache)
    out = attention.paged_attention(*case.args(), case.scale)
    tol = {torch.float16: 2e-3, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, dense_attention(case), atol=tol, rtol=tol)


def test_launcher_refuses_what_would_read_outside_its_tensors():
    case = make_case([1, 1], [10, 20], 4, 2, 64, seed=1)
    out = torch.empty_like(case.q)
    ids = torch.tensor([0, 1], dtype=torch.int32)

    def call(**changes):
        args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_tables=case.block_tables,
                    cu_seqlens_q=case.cu_seqlens_q, context_lens=case.context_lens, seq_ids=ids, out=out)
        attention.paged_decode(**(args | changes), scale=case.scale)

    with pytest.raises(ValueError, match="seq_ids must be a contiguous CPU torch.int32"):
        call(seq_ids=ids.long())
    with pytest.raises(ValueError, match="block_tables must be"):
        call(block_tables=case.block_tables.t().contiguous().t())
    with pytest.raises(ValueError, match="does not take"):  # the cache's head size is not q's
        call(k_cache=case.k_cache[..., :32].contiguous(), v_cache=case.v_cache[..., :32].contiguous())
    with pytest.raises(ValueError, match="seq_ids must index the 2 sequences"):
        call(seq_ids=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="token lies outside q"):
        call(cu_seqlens_q=torch.tensor([0, 7, 8], dtype=torch.int32))
    call()
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad", [-1, 10_000])
def test_a_bad_block_id_is_refused_before_the_kernel_reads_it(bad):
    case = make_case([1, 1], [40, 20], 4, 2, 64, seed=6)
    tables = case.block_tables.clone()
    tables[0, 1] = bad  # inside sequence 0's context (blocks 0..2)
    with pytest.raises(ValueError, match="outside the KV pool"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q,
                                      case.context_lens, case.scale)
    tables = case.block_tables.clone()
    tables[1, 2:] = bad  # past sequence 1's context (two blocks): padding, never read
    out = attention.paged_attention(case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q,
                                        case.context_lens, case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=2e-5)


def test_a_context_length_near_2_31_does_not_wrap_the_check():
    case = make_case([1, 1], [10, 20], 4, 2, 64, seed=6)
    lens = torch.tensor([2**31 - 1, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="shorter than its context"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                                      lens, case.scale)


def test_the_tables_check_reports_each_kind_of_fault_over_every_row_first():
    """paged_check_tables (C, once a step): an empty context before a short table before a bad id,
    whichever row holds each, in a decode step and in a step with a prefill run."""
    case = make_case([1, 1], [40, 20], 4, 2, 64, seed=6)
    tables = case.block_tables.clone()
    tables[0, 1] = -1  # a bad id in row 0
    lens = torch.tensor([40, 0], dtype=torch.int32)  # and an empty context in row 1
    with pytest.raises(ValueError, match="empty context"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q, lens, case.scale)
    block_size = case.k_cache.shape[1]
    lens = torch.tensor([40, block_size * tables.shape[1] + 1], dtype=torch.int32)  # row 1's context past its table
    with pytest.raises(ValueError, match="shorter than its context"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q, lens, case.scale)
    with pytest.raises(ValueError, match="outside the KV pool"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, tables, case.cu_seqlens_q, case.context_lens,
                                  case.scale)
    with pytest.raises(IndexError):  # a decode step whose tables or lengths miss a sequence: never read past them
        attention.paged_attention(case.q, case.k_cache, case.v_cache, tables[:1], case.cu_seqlens_q,
                                  case.context_lens, case.scale)
    with pytest.raises(IndexError):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                                  case.context_lens[:1], case.scale)
    mixed = make_case([3, 1], [40, 20], 4, 2, 64, seed=6)  # a prefill run of three tokens, then a decode token
    tables = mixed.block_tables.clone()
    tables[1, 0] = mixed.k_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        attention.paged_attention(mixed.q, mixed.k_cache, mixed.v_cache, tables, mixed.cu_seqlens_q,
                                  mixed.context_lens, mixed.scale)


def test_a_decreasing_cu_seqlens_is_refused():
    case = make_case([1, 1], [4, 5], 4, 2, 64, seed=6)
    with pytest.raises(ValueError, match="never decrease"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                      torch.tensor([0, 2, 1], dtype=torch.int32), case.context_lens, case.scale)


# ---- routing: which query rows of a step the C kernel takes ----


@pytest.fixture
def routed(monkeypatch):
    """(rows the C kernel gets per call, prefill runs the twin gets), counted per layer call."""
    calls, prefills = [], []
    real_c, real_twin = attention._decode_rows, twin.prefill_attention
    monkeypatch.setattr(attention, "_decode_rows", lambda plan, *a: calls.append(plan.rows.numel()) or real_c(plan, *a))
    monkeypatch.setattr(twin, "prefill_attention",
                        lambda q, *a, **k: prefills.append(q.shape[0]) or real_twin(q, *a, **k))
    monkeypatch.setattr(twin, "_decode", lambda *a, **k: pytest.fail("decode rows went to the twin"))
    return calls, prefills


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_prefills_run_in_c_as_rows_with_causal_contexts(dtype, routed):
    # decode rows; a whole prompt; a chunk on a cached prefix; a run of exactly the limit; one
    # token past it (the twin's); one-token contexts
    limit = attention.PREFILL_ROWS_IN_C
    q_lens = [1, 20, 1, 7, limit, limit + 1, 1]
    ctx_lens = [50, 20, 1, 40, limit + 3, limit + 30, 129]
    case = make_case(q_lens, ctx_lens, 6, 2, 64, dtype=dtype, seed=3)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    calls, prefills = routed
    assert calls == [3 + 20 + 7 + limit] and prefills == [limit + 1]


def test_a_step_of_prefills_alone_runs_in_c(routed):
    case = make_case([3, 16, 2], [3, 33, 18], 4, 4, 32, block_size=8, seed=4)
    out = attention.paged_attention(*case.args(), case.scale)
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert routed == ([21], [])


def test_a_prefill_row_past_the_pool_is_refused(routed):
    case = make_case([5, 1], [40, 9], 4, 2, 32, seed=6)
    case.block_tables[0, 2] = case.k_cache.shape[0]  # the prefill's third block: outside the pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        attention.paged_attention(*case.args(), case.scale)


# ---- sliding windows and soft caps ----


WINDOWS = [0, 5, 21, 1000]  # none, shorter than a block, ending mid-block, longer than every context


def windowed_case(window: int, softcap: float, dtype: torch.dtype, freed: str, block_size: int):
    """Decode rows (one that pads beside longer ones), a whole prompt and chunks on a cached prefix
    (C rows), a run past PREFILL_ROWS_IN_C (the twin's unless invariant); 3 query heads a KV head.
    With a soft cap, q is scaled so that the scores reach where tanh bends them."""
    limit = attention.PREFILL_ROWS_IN_C
    q_lens, ctx_lens = [1, 1, 1, 9, 30, 12, limit + 6], [50, 3, 130, 9, 30, 100, limit + 80]
    case = make_case(q_lens, ctx_lens, 9, 3, 64, block_size=block_size, dtype=dtype, seed=window, window=window,
                     freed=freed)
    if softcap:
        case.q.mul_(10.0)
    return case


@pytest.mark.parametrize(("dtype", "freed", "block_size"), [(torch.float32, "nan", 16), (torch.bfloat16, "-1", 32)])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_and_soft_capped_attention_matches_dense_and_the_twin(window, softcap, dtype, freed, block_size,
                                                                       routed):
    # the blocks before each sequence's window are freed: -1 in the table, or another's (NaN)
    case = windowed_case(window, softcap, dtype, freed, block_size)
    expected, tol = dense_attention(case, softcap=softcap), 2 * TOL[dtype]
    kwargs = dict(window=window, softcap=softcap)
    out = attention.paged_attention(*case.args(), case.scale, **kwargs)
    assert not out.isnan().any(), "a freed block was read"
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    # the twin's invariant path: its decode path would count as rows gone to the twin
    torch.testing.assert_close(out, twin.invariant_paged_attention(*case.args(), case.scale, **kwargs), atol=tol,
                               rtol=tol)
    assert routed == ([3 + 9 + 30 + 12], [attention.PREFILL_ROWS_IN_C + 6])
    every_row_in_c = attention.paged_attention(*case.args(), case.scale, invariant=True, **kwargs)
    torch.testing.assert_close(every_row_in_c, expected, atol=tol, rtol=tol)
    if window > max(case.context_lens.tolist()):  # a window over the whole context changes no bit
        assert torch.equal(out, attention.paged_attention(*case.args(), case.scale, softcap=softcap))
        assert torch.equal(every_row_in_c,
                           attention.paged_attention(*case.args(), case.scale, invariant=True, softcap=softcap))


@pytest.mark.parametrize("window", [1, 16, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_may_start_anywhere_in_a_block(window, dtype, c_only):
    # decode rows whose windows start at every offset of a block of 32 (two chunks of 16), and past it
    ctx_lens = [window + k for k in range(40)]
    case = make_case([1] * 40, ctx_lens, 6, 2, 64, block_size=32, dtype=dtype, seed=window, window=window,
                     freed="nan")
    out = attention.paged_attention(*case.args(), case.scale, window=window)
    assert not out.isnan().any(), "a freed block was read"
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[dtype], rtol=TOL[dtype])
    assert c_only == [40]


def test_only_the_blocks_inside_the_windows_are_checked():
    case = windowed_case(21, 0.0, torch.float32, "-1", 16)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables.clone(), *case.args()[4:], case.scale)
    out = attention.paged_attention(*args, window=21)  # the -1 entries before the windows: not read
    torch.testing.assert_close(out, dense_attention(case), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    with pytest.raises(ValueError, match="outside the KV pool"):  # a global layer of the same step reads them
        attention.paged_attention(*args, window=0)
    tables = case.block_tables.clone()
    tables[2, 130 // 16] = 10_000  # inside the window of sequence 2 (context 130)
    with pytest.raises(ValueError, match="outside the KV pool"):
        attention.paged_attention(case.q, case.k_cache, case.v_cache, tables, *case.args()[4:], case.scale,
                                  window=21)


def test_paged_decode_takes_a_window_and_a_soft_cap():
    case = make_case([1, 1], [10, 40], 4, 2, 64, seed=1, window=5, freed="nan")
    case.q.mul_(10.0)
    out = torch.empty_like(case.q)
    attention.paged_decode(*case.args(), torch.tensor([0, 1], dtype=torch.int32), out, case.scale, window=5,
                           softcap=30.0)
    torch.testing.assert_close(out, dense_attention(case, softcap=30.0), atol=4e-5, rtol=4e-5)

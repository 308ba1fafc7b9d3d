"""Scheduler: token budget, chunked prefill, mixed steps, preemption, rejection, prefix grouping, windows."""

from batchapi.engine.block_manager import BlockManager
from batchapi.engine.request import ErrorCode
from batchapi.engine.scheduler import Scheduler
from batchapi.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, max_num_seqs=4, budget=8, max_model_len=64, caching=True, window=None):
    bm = BlockManager(num_blocks, block_size, caching, window=window)
    return Scheduler(bm, max_num_seqs, budget, max_model_len)


def add(sched, request_id, tokens):
    s = Sequence(request_id, list(tokens), params=None)
    sched.add(s)
    return s


def step(sched, sample=None):
    """One schedule + postprocess; append token 7 to every seq that caught up."""
    batch = sched.schedule()
    plan = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
    caught_up = [s for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                 if s.num_computed_tokens + n == s.num_tokens]
    sched.postprocess(batch)
    for s in caught_up:
        s.token_ids.append(7)
    sched.release_finished()
    return plan


def test_chunked_prefill_mixes_with_decode_under_the_budget():
    sched = make(budget=8)
    a = add(sched, "a", range(5))
    b = add(sched, "b", range(100, 120))
    assert step(sched) == [("a", 5), ("b", 3)]
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert step(sched) == [("a", 1), ("b", 7)]  # a decodes, b's prompt continues
    assert step(sched) == [("a", 1), ("b", 7)]
    assert step(sched) == [("a", 1), ("b", 3)]  # b's last chunk, then both decode
    assert step(sched) == [("a", 1), ("b", 1)]
    # running seqs grow in order: a takes block 7 for its 9th token, then b block 8
    assert b.block_table == [2, 3, 4, 5, 6, 8] and b.num_computed_tokens == 21
    assert a.block_table == [0, 1, 7] and a.num_computed_tokens == 9


def test_sequence_cap_keeps_extra_requests_waiting():
    sched = make(max_num_seqs=2, budget=32)
    for i, r in enumerate("abc"):
        add(sched, r, range(10 * i, 10 * i + 3))
    assert step(sched) == [("a", 3), ("b", 3)]
    sched.running[0].finish("stop")
    sched.release_finished()
    assert step(sched) == [("b", 1), ("c", 3)]


def test_the_cap_counts_the_children_a_prefilling_parent_forks_later():
    # a, b and c are n=2 requests: each forks a child once its prompt is done. Four slots hold
    # two of them with their children; c waits, even while a and b are still prefilling
    sched = make(max_num_seqs=4, budget=8)
    a = add(sched, "a", range(12))
    b, c = (add(sched, name, range(50 + i, 53 + i)) for i, name in enumerate("bc"))
    for seq in (a, b, c):
        seq.num_forks = 1
    assert step(sched) == [("a", 8)]
    assert step(sched) == [("a", 4), ("b", 3)]  # budget left for c, but no slot for c and its child
    for parent in (a, b):  # both prompts done: each forks its child, with its own first token (LLMEngine._fork)
        parent.num_forks = 0
        child = Sequence(parent.request_id, list(parent.token_ids[: parent.num_prompt_tokens]), params=None)
        sched.fork(parent, child)
        child.token_ids.append(8)
    assert [r for r, _ in step(sched)] == ["a", "b", "a", "b"] and c.status is SequenceStatus.WAITING


def test_preemption_frees_the_newest_and_recomputes_it_later():
    sched = make(num_blocks=4, block_size=4, budget=32)
    a = add(sched, "a", range(7))
    b = add(sched, "b", range(50, 57))
    assert step(sched) == [("a", 7), ("b", 7)]
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert step(sched) == [("a", 1), ("b", 1)]  # 8 tokens each: blocks still hold them
    # a needs a third block: none free, so b (admitted last) is preempted and requeued first
    assert step(sched) == [("a", 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    # b's cached blocks were freed tail first, so a took b's second block (3), LRU
    assert a.block_table == [0, 1, 3] and sched.num_preemptions == 1
    a.finish("stop")
    sched.release_finished()
    # b comes back: its first block (2) is still cached; the rest is recomputed
    assert step(sched) == [("b", 5)]
    assert b.num_computed_tokens == 9 and b.block_table == [2, 3, 1]


def test_request_that_can_never_fit_is_rejected_with_an_error():
    sched = make(max_model_len=16)
    s = add(sched, "big", range(16))
    assert s.is_finished and s.finish_reason == "error" and "at most 16 tokens" in s.error
    assert s.error_code is ErrorCode.PROMPT_TOO_LONG
    assert sched.rejected == [s] and len(sched.waiting) == 0
    empty = add(sched, "empty", [])
    assert empty.finish_reason == "error" and empty.error_code is ErrorCode.PROMPT_EMPTY
    assert sched.schedule().seqs == []


def test_waiting_requests_grouped_by_shared_prefix():
    sched = make(block_size=4, budget=64, max_num_seqs=8)
    shared = list(range(16))
    add(sched, "p1", shared + [1, 2])
    add(sched, "other", range(200, 230))
    add(sched, "p2", shared + [3, 4])
    order = [s.request_id for s in sched.waiting]
    assert order == ["p1", "p2", "other"]
    # p1 computes the shared blocks; p2 waits one step and hits them instead of recomputing,
    # while the next group goes ahead
    assert step(sched) == [("p1", 18), ("other", 30)]
    assert step(sched) == [("p1", 1), ("other", 1), ("p2", 2)]


def test_abort_frees_blocks():
    sched = make(budget=32)
    a = add(sched, "a", range(6))
    add(sched, "b", range(10, 16))
    step(sched)
    assert sched.bm.num_free_blocks == 12
    assert [s.request_id for s in sched.abort("a")] == ["a"]
    assert sched.bm.num_free_blocks == 14 and a not in sched.running
    assert [s.request_id for s in sched.abort("b")] == ["b"] and not sched.has_work()


def test_partial_block_prefix_is_copied_from_a_sequence_admitted_in_the_same_step():
    from batchapi.engine.scheduler import KVCopy

    sched = make(block_size=4, budget=64, max_num_seqs=8)
    a = add(sched, "a", [1, 9, 9])
    b = add(sched, "b", [1, 2, 3, 5])
    c = add(sched, "c", [1, 2, 3])
    batch = sched.schedule()
    # b reuses a's first token; c reuses b's first two, one of which b itself receives by a
    # copy this step: c's copy runs in the next wave. Each leaves its last token to compute.
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)] == [
        ("a", 3), ("b", 3), ("c", 1)]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    assert batch.kv_copies == [KVCopy(src=0, dst=1, num_tokens=1, wave=0), KVCopy(src=1, dst=2, num_tokens=2, wave=1)]
    assert (b.num_computed_tokens, b.num_cached_tokens, c.num_computed_tokens, c.num_cached_tokens) == (1, 1, 2, 2)


def test_partial_block_prefix_after_cached_blocks_comes_from_a_running_sequence():
    from batchapi.engine.scheduler import KVCopy

    sched = make(block_size=4, budget=64, max_num_seqs=8)
    a = add(sched, "a", [1, 2, 3, 4, 5, 6, 7])
    step(sched)  # a's prompt is computed and a token 7 appended: a = 1..7, 7
    b = add(sched, "b", [1, 2, 3, 4, 5, 6, 8, 9])
    d = add(sched, "d", [1, 2, 3, 4, 5, 6])
    batch = sched.schedule()
    # block 0 is a cache hit for both; block 1 starts with a's 5, 6 (a decodes its 7 there this
    # step, so that one counts too); d's prompt lies wholly in a, but its last token is computed
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)] == [
        ("a", 1), ("b", 2), ("d", 1)]
    assert b.block_table[0] == d.block_table[0] == a.block_table[0]
    assert batch.kv_copies == [KVCopy(a.block_table[1], b.block_table[1], 2), KVCopy(a.block_table[1], d.block_table[1], 1)]
    assert (b.num_cached_tokens, d.num_cached_tokens) == (6, 5)


def test_no_partial_copies_without_prefix_caching():
    sched = make(block_size=4, budget=64, max_num_seqs=8, caching=False)
    add(sched, "a", [1, 2, 3, 4, 5])
    step(sched)
    add(sched, "b", [1, 2, 3, 4, 5, 6])
    batch = sched.schedule()
    assert batch.kv_copies == [] and batch.num_new_tokens == [1, 6]


def test_admission_from_one_large_group_takes_its_head_in_order():
    # a whole batch sharing a system prompt is one waiting group: admitting takes its first
    # sequences (popleft), the rest keep their order and the queue's size stays right
    sched = make(num_blocks=4096, max_num_seqs=8, budget=4096, max_model_len=64)
    shared = list(range(16))
    seqs = [add(sched, f"r{i}", shared + [100 + i]) for i in range(2000)]
    step(sched)  # r0 alone: the others wait a step for its blocks to be cached
    step(sched)
    assert [s.request_id for s in sched.running] == [f"r{i}" for i in range(8)]
    assert len(sched.waiting) == 1992
    assert next(iter(sched.waiting)) is seqs[8]
    for s in sched.running:
        s.status = SequenceStatus.FINISHED
    sched.release_finished()
    step(sched)
    assert [s.request_id for s in sched.running] == [f"r{i}" for i in range(8, 16)]  # cache hits: all at once
    assert len(sched.waiting) == 1984 and len(sched.waiting.groups) == 1


def test_after_a_shared_prefix_one_sequence_of_each_next_block_is_admitted_at_once():
    # few-shot evals: one group (the shared prefix), four choices per question after it. Once the
    # prefix is cached, the first choice of every question runs in one step; the others of a
    # question wait a step for its stem block, and keep their order
    sched = make(num_blocks=512, block_size=4, max_num_seqs=16, budget=512, max_model_len=64)
    prefix = list(range(8))
    choices = {q: [add(sched, f"q{q}c{c}", prefix + [100 + q] * 4 + [200 + c]) for c in range(4)] for q in range(3)}
    assert [r for r, _ in step(sched)] == ["q0c0"]  # the prefix is computed once
    assert [r for r, _ in step(sched)] == ["q0c0", "q0c1", "q0c2", "q0c3", "q1c0", "q2c0"]  # q0c0 decodes
    assert [s.request_id for s in sched.waiting] == ["q1c1", "q1c2", "q1c3", "q2c1", "q2c2", "q2c3"]
    assert len(sched.waiting) == 6
    assert [r for r, _ in step(sched)][-6:] == ["q1c1", "q1c2", "q1c3", "q2c1", "q2c2", "q2c3"]
    assert all(s.num_cached_tokens == 12 for s in choices[1][1:] + choices[2][1:])  # prefix and stem: hits
    assert len(sched.waiting) == 0 and not sched.waiting.groups


# ---- sliding window ----


def held(s):
    return [b for b in s.block_table if b != -1]


def test_a_long_generation_under_a_window_holds_a_bounded_number_of_blocks():
    # 400 tokens would take 100 blocks; the token at p reads p-7..p, so a decode step holds at most 3
    sched = make(num_blocks=8, block_size=4, budget=8, max_model_len=1000, window=8)
    a = add(sched, "a", range(6))
    b = add(sched, "b", range(100, 106))
    most = 0
    while a.num_tokens < 400:
        batch = sched.schedule()  # grown for the step: the most a sequence holds
        most = max(most, len(held(a)), len(held(b)))
        assert sched.bm.num_free_blocks == 8 - len(held(a)) - len(held(b))
        sched.postprocess(batch)
        for s in (a, b):
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
    assert most == 3 and sched.num_preemptions == 0
    assert len(a.block_table) == sched.bm.blocks_for(a.num_computed_tokens + 1)  # places still count tokens
    assert a.block_table[: (a.num_computed_tokens - 7) // 4] == [-1] * ((a.num_computed_tokens - 7) // 4)
    a.finish("stop")
    sched.release_finished()
    assert sched.abort("b") == [b] and sched.bm.num_free_blocks == 8


def test_no_window_keeps_every_block():
    sched = make(num_blocks=16, block_size=4, budget=8, window=None)
    a = add(sched, "a", range(6))
    for _ in range(20):
        step(sched)
    assert a.block_table == list(range(7)) and -1 not in a.block_table


def test_a_prompt_longer_than_the_window_is_chunked_within_a_small_pool():
    # 40 prompt tokens in an 8-block pool: each chunk of 8 holds its blocks and the window's
    sched = make(num_blocks=8, block_size=4, budget=8, max_model_len=100, window=6)
    a = add(sched, "a", range(40))
    most = 0
    while a.num_computed_tokens < 40:
        batch = sched.schedule()
        most = max(most, len(held(a)))
        sched.postprocess(batch)
    assert most == 4 and a.block_table[:8] == [-1] * 8 and sched.num_preemptions == 0


def test_prefix_hits_on_released_blocks_of_a_shared_prompt():
    sched = make(num_blocks=16, block_size=4, budget=32, max_model_len=100, window=6)
    shared = list(range(16))
    a = add(sched, "a", shared + [50, 51])
    step(sched)  # a's next token (18) reads 13..18: blocks 0..2 released, still cached
    assert a.block_table == [-1, -1, -1, 3, 4]
    b = add(sched, "b", shared + [60, 61])
    batch = sched.schedule()
    # b hits 4 blocks; its first token (16) reads 11..16: block 2 is taken back from the pool,
    # block 3 shared with a, and blocks 0, 1 are not held at all
    assert batch.num_new_tokens == [1, 2] and b.num_cached_tokens == 16
    assert b.block_table == [-1, -1, 2, 3, 5]
    assert sched.bm.ref_counts[:6] == [0, 0, 1, 2, 1, 1]
    sched.postprocess(batch)  # b's next token (18) reads 13..18: block 2 goes back
    assert b.block_table == [-1, -1, -1, 3, 5] and sched.bm.ref_counts[2] == 0


def test_a_donor_whose_block_was_released_cannot_donate():
    sched = make(num_blocks=16, block_size=4, budget=32, window=4)
    a = add(sched, "a", range(8))
    step(sched)  # a's next token (8) reads 5..8: block 0 released
    assert a.block_table[0] == -1
    sched.bm.reset_prefix_cache()  # block 0 forgotten: no hit, and a holds nothing at place 0
    add(sched, "b", range(6))
    batch = sched.schedule()
    assert batch.kv_copies == [] and batch.num_new_tokens == [1, 6]


def test_a_fork_reads_blocks_its_parent_keeps_for_it():
    sched = make(num_blocks=16, block_size=4, budget=32, window=4)
    parent = add(sched, "p", range(11))
    parent.num_forks = 1
    sched.postprocess(sched.schedule())
    # the parent's next token (11) reads 8..11 but the child's first (8) reads 5..8: block 1 stays
    assert parent.block_table == [-1, 1, 2]
    child = Sequence("p", list(range(11)), params=None, sample_index=1)
    sched.fork(parent, child)
    parent.num_forks = 0
    assert child.block_table == [-1, 1] and child.num_computed_tokens == 8
    assert sched.bm.ref_counts[:3] == [0, 2, 1]
    parent.token_ids.append(7)
    child.token_ids.append(8)
    assert step(sched) == [("p", 1), ("p", 4)]  # the child recomputes its tail, 8..11
    # the next tokens (12) read 9..12: neither reads block 1 any more
    assert parent.block_table == [-1, -1, 2] and child.block_table == [-1, -1, 3]
    assert sched.bm.ref_counts[:4] == [0, 0, 1, 1]


def test_preempted_sequence_under_a_window_comes_back_on_its_window_of_cached_blocks():
    sched = make(num_blocks=6, block_size=4, budget=32, max_model_len=100, window=6)
    a = add(sched, "a", range(20))
    step(sched)  # the next token (20) reads 15..20: blocks 3, 4 are held
    assert a.block_table == [-1, -1, -1, 3, 4]
    sched._preempt(sched.running.pop())  # as the preemption loop does
    assert a.block_table == [] and sched.bm.num_free_blocks == 6
    # back: blocks 3, 4 hit (0..2 need not, though cached); only the token at 20 is computed
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] and a.num_computed_tokens == 20
    assert a.block_table == [-1, -1, -1, 3, 4, 5]

"""BlockManager: exact block ids through allocation, prefix hits, LRU eviction, forks and window releases."""

from batchapi.engine.block_manager import BlockManager
from batchapi.engine.sequence import Sequence


def seq(tokens):
    return Sequence("r", list(tokens), params=None)


def computed(bm, s, num_tokens):
    s.num_computed_tokens = num_tokens
    bm.cache_full_blocks(s)


def test_allocation_takes_lowest_free_ids_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(10)), seq(range(100, 105))
    bm.admit(a, [], [], 10)
    bm.admit(b, [], [], 5)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    assert bm.grow(a, 12) and a.block_table == [0, 1, 2]
    assert bm.grow(a, 13) and a.block_table == [0, 1, 2, 5]
    assert not bm.grow(b, 5 + 4 * 3)  # needs 3 more blocks, 2 free
    assert b.block_table == [3, 4]


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(12))
    bm.admit(a, [], [], 12)
    computed(bm, a, 12)
    # same 12 tokens: only 2 blocks hit, since the last token must be computed again
    b = seq(range(12))
    cached, hashes = bm.match_prefix(b)
    assert cached == [0, 1]
    bm.admit(b, cached, hashes, 12)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    # a different third block: 2 hits, then a miss
    c = seq([*range(8), 99, 98, 97, 96, 95])
    assert bm.match_prefix(c)[0] == [0, 1]
    # a different first token: no hit at all
    assert bm.match_prefix(seq([7, *range(1, 12)]))[0] == []


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9))
    bm.admit(a, [], [], 9)
    computed(bm, a, 9)
    bm.free_blocks(a)
    assert bm.num_free_blocks == 4 and bm.usage() == 0.0
    # block 2 held one token, not cached: it goes out first, then the never-used block 3
    b = seq(range(50, 58))
    bm.admit(b, [], [], 8)
    assert b.block_table == [2, 3]
    # the cached prefix 0, 1 is still found; freeing kept it
    c = seq(range(9))
    cached, hashes = bm.match_prefix(c)
    assert cached == [0, 1]
    assert bm.can_admit(cached, 9) is False  # both cached blocks are free but the third needs a free one
    bm.free_blocks(b)
    bm.admit(c, cached, hashes, 9)
    # b freed tail first, each uncached block to the front of the queue: [2, 3, 0, 1]
    assert c.block_table == [0, 1, 2] and c.num_computed_tokens == 8


def test_eviction_forgets_the_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(range(5))
    bm.admit(a, [], [], 5)
    computed(bm, a, 5)
    bm.free_blocks(a)
    b = seq(range(100, 108))  # needs both blocks: evicts the cached block 0
    bm.admit(b, [], [], 8)
    assert sorted(b.block_table) == [0, 1]
    bm.free_blocks(b)
    assert bm.match_prefix(seq(range(5)))[0] == []


def test_no_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(9))
    bm.admit(a, [], [], 9)
    computed(bm, a, 9)
    assert bm.match_prefix(seq(range(9))) == ([], [])


def test_fork_shares_full_blocks_and_recomputes_the_tail():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(range(10))
    bm.admit(parent, [], [], 10)
    computed(bm, parent, 10)
    child = seq(range(10))
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and child.num_computed_tokens == 8
    assert bm.ref_counts[:3] == [2, 2, 1]
    bm.grow(child, 11)
    assert child.block_table == [0, 1, 3]
    bm.free_blocks(parent)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]


# ---- sliding window: blocks wholly before the window of the next token are released ----


def advance(bm, s, num_tokens):
    """What the scheduler's update does: count the tokens, register full blocks, then release."""
    computed(bm, s, num_tokens)
    bm.release_outside_window(s)


def test_a_block_is_released_once_its_last_position_leaves_the_next_tokens_window():
    bm = BlockManager(num_blocks=8, block_size=4, window=6)
    a = seq(range(12))
    bm.admit(a, [], [], 12)
    # the token at 8 attends to 3..8: block 0 (0..3) is still read
    advance(bm, a, 8)
    assert a.block_table == [0, 1, 2] and bm.ref_counts[:3] == [1, 1, 1]
    # the token at 9 attends to 4..9: block 0 is not, and goes back to the pool still cached
    table = a.block_table
    advance(bm, a, 9)
    assert a.block_table == [-1, 1, 2] and a.block_table is table  # in place: the runner keeps its row
    assert bm.ref_counts[:3] == [0, 1, 1] and bm.num_free_blocks == 6
    assert bm.block_hash[0] is not None and next(reversed(bm.free)) == 0  # cached, at the LRU's recent end
    advance(bm, a, 12)  # 7..12: block 1 (4..7) is still read
    assert a.block_table == [-1, 1, 2]
    bm.grow(a, 14)
    advance(bm, a, 13)  # 8..13
    assert a.block_table == [-1, -1, 2, 3] and bm.num_free_blocks == 6


def test_no_window_releases_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(24))
    bm.admit(a, [], [], 24)
    advance(bm, a, 24)
    assert a.block_table == [0, 1, 2, 3, 4, 5] and bm.num_free_blocks == 2


def test_a_chunk_releases_several_blocks_oldest_first():
    bm = BlockManager(num_blocks=8, block_size=4, window=4)
    a = seq(range(20))
    bm.admit(a, [], [], 20)
    advance(bm, a, 20)  # 17..20: blocks 0..3 go, the oldest first so it is evicted first
    assert a.block_table == [-1, -1, -1, -1, 4]
    assert list(bm.free) == [5, 6, 7, 0, 1, 2, 3]


def test_released_blocks_are_handed_to_other_sequences():
    bm = BlockManager(num_blocks=3, block_size=4, window=4, enable_prefix_caching=False)
    a = seq(range(8))
    bm.admit(a, [], [], 8)
    bm.grow(a, 9)
    advance(bm, a, 8)  # 5..8: block 0 goes, uncached, to the front of the queue
    assert a.block_table == [-1, 1, 2]
    b = seq(range(100, 104))
    assert bm.can_admit([], 4)
    bm.admit(b, [], [], 4)
    assert b.block_table == [0] and bm.num_free_blocks == 0
    bm.free_blocks(a)  # skips the released place: block 0 is b's now
    assert bm.ref_counts == [1, 0, 0] and bm.num_free_blocks == 2 and a.block_table == []


def test_prefix_hit_reclaims_a_released_block_that_is_not_evicted():
    bm = BlockManager(num_blocks=8, block_size=4, window=4)
    a = seq(range(9))
    bm.admit(a, [], [], 9)
    advance(bm, a, 8)  # 5..8: block 0 released, cached
    assert a.block_table == [-1, 1, 2] and bm.ref_counts[0] == 0
    b = seq([0, 1, 2, 3, 50])  # the token at 4 reads 1..4: block 0 is needed and hits
    cached, hashes = bm.match_prefix(b)
    assert cached == [0] and bm.can_admit(cached, 5)
    bm.admit(b, cached, hashes, 5)
    assert b.block_table == [0, 3] and bm.ref_counts[0] == 1 and 0 not in bm.free


def test_prefix_hit_needs_only_the_blocks_in_the_window_of_its_end():
    bm = BlockManager(num_blocks=5, block_size=4, window=6)
    a = seq(range(13))
    bm.admit(a, [], [], 13)
    advance(bm, a, 13)  # 8..13: blocks 0, 1 released, cached
    assert a.block_table == [-1, -1, 2, 3] and list(bm.free) == [4, 0, 1]
    # a hit of 3 blocks computes the token at 12, which reads 7..12: blocks 1, 2 only, so block 0
    # is not held even though it is cached
    c = seq(range(13))
    assert bm.match_prefix(c)[0] == [-1, 1, 2]
    evict = seq(range(200, 208))
    bm.admit(evict, [], [], 8)
    assert evict.block_table == [4, 0]  # block 0 evicted: the hit does not need it
    bm.free_blocks(evict)
    cached, hashes = bm.match_prefix(c)
    assert cached == [-1, 1, 2] and len(hashes) == 3
    assert bm.can_admit(cached, 13)  # a new block for the token at 12, and block 1 taken back
    bm.admit(c, cached, hashes, 13)
    assert c.block_table == [-1, 1, 2, 4] and c.num_computed_tokens == 12
    assert bm.ref_counts == [0, 1, 2, 1, 1] and list(bm.free) == [0]
    bm.free_blocks(c)
    assert bm.ref_counts == [0, 0, 1, 1, 0]


def test_a_miss_inside_the_window_shortens_the_hit():
    bm = BlockManager(num_blocks=8, block_size=4, window=6)
    a = seq(range(13))
    bm.admit(a, [], [], 13)
    computed(bm, a, 12)
    bm.hash_to_block.pop(bm.block_hash[1])  # block 1 forgotten: hits ending at 2 or 3 blocks read it
    assert bm.match_prefix(seq(range(13)))[0] == [0]


def test_fork_shares_released_places_and_what_the_childs_window_reads():
    bm = BlockManager(num_blocks=8, block_size=4, window=4)
    parent = seq(range(11))
    parent.num_forks = 1
    bm.admit(parent, [], [], 11)
    # the parent's next token (11) reads 8..11, but the child restarts at 8 and reads 5..8:
    # block 1 stays until the fork
    advance(bm, parent, 11)
    assert parent.block_table == [-1, 1, 2]
    child = seq(range(11))
    bm.fork(parent, child)
    assert child.block_table == [-1, 1] and child.num_computed_tokens == 8
    assert bm.ref_counts[:3] == [0, 2, 1]
    parent.num_forks = 0
    bm.release_outside_window(parent)
    assert parent.block_table == [-1, -1, 2] and bm.ref_counts[:3] == [0, 1, 1]
    bm.free_blocks(child)
    bm.free_blocks(parent)
    assert bm.num_free_blocks == 8


def test_fork_from_a_parent_that_released_what_the_child_reads_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, window=4)
    parent = seq(range(11))
    bm.admit(parent, [], [], 11)
    advance(bm, parent, 11)  # no forks pending: block 1 goes too
    assert parent.block_table == [-1, -1, 2]
    child = seq(range(11))
    bm.fork(parent, child)
    assert child.block_table == [] and child.num_computed_tokens == 0 and bm.ref_counts[2] == 1

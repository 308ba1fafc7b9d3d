"""BlockManager: exact block ids through allocation, prefix hits, LRU eviction and forks."""

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

"""Paged KV cache bookkeeping: which block holds which tokens, shared and cached how.

Plain Python (no torch). Blocks are ref-counted. A full block is registered under a chained
hash (its tokens and the hash of the block before it), so a later prompt with the same prefix
reuses it. A freed block keeps its hash and sits in the free queue in LRU order; it is only
forgotten when the queue hands it out again (lazy eviction). Blocks that hold nothing
reusable go to the front of the queue so cached ones live longer.

When every layer attends only to the last ``window`` positions, a block wholly before the window
of a sequence's next token is never read again: it is released (as a freed block is: kept cached
until evicted) and its place in ``seq.block_table`` becomes -1. Released places keep their index,
so table lengths still count tokens. A prefix hit then needs only the blocks that the window of
its first computed token reaches; earlier places are -1 even where still cached.
"""

from __future__ import annotations

from collections import OrderedDict

from batchapi.engine.sequence import Sequence


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    # tuples of ints hash deterministically in CPython (no per-process salt)
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        assert num_blocks > 0, "the KV pool needs at least one block"
        assert window is None or window > 0, f"an attention window of {window} positions"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's attention window; None: some layer sees the whole context
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # evict from the front

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (those in use keep their contents, unregistered)."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def window_start_block(self, position: int) -> int:
        """The first block that a query at ``position`` reads; those before it are never read again
        by this query or later ones."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    def _take(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        old = self.block_hash[block_id]
        if old is not None:
            if self.hash_to_block.get(old) == block_id:
                del self.hash_to_block[old]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None
        assert self.ref_counts[block_id] == 0, f"block {block_id} handed out while in use"
        self.ref_counts[block_id] = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks for the start of ``seq``: (block ids, their hashes).

        At least one token is always left to compute, since its logits are needed. Under a window
        the hit is the longest prefix whose blocks from its end's window start on are cached; the
        places before that are -1 (not held, cached or not).
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        blocks, hashes, prev = [], [], None
        run_start = best = 0  # run_start: first block of the run of hits ending at the current one
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            prev = chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.block_tokens[block_id] != tokens:
                if self.window is None:
                    break  # every block of a hit is read: none past a miss can count
                block_id, run_start = -1, i + 1
            blocks.append(block_id)
            hashes.append(prev)
            if run_start <= self.window_start_block((i + 1) * bs):
                best = i + 1
        skip = self.window_start_block(best * bs)
        return [-1] * skip + blocks[skip:best], hashes[:best]

    def prompt_hashes(self, seq: Sequence, start: int, prev: int | None) -> list[int]:
        """Chained hashes of the full prompt blocks of ``seq`` from block ``start`` on."""
        bs = self.block_size
        out = []
        for i in range(start, seq.num_prompt_tokens // bs):
            prev = chain_hash(prev, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            out.append(prev)
        return out

    def can_admit(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a waiting seq with ``cached`` hit blocks can hold ``num_tokens`` tokens."""
        reclaimed = sum(1 for b in cached if b != -1 and self.ref_counts[b] == 0)
        return self.blocks_for(num_tokens) - len(cached) + reclaimed <= len(self.free)

    def admit(self, seq: Sequence, cached: list[int], hashes: list[int], num_tokens: int) -> None:
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        for block_id in cached:
            if block_id == -1:
                continue
            if self.ref_counts[block_id] == 0:
                del self.free[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(cached)
        seq.block_hashes = list(hashes)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` enough blocks for ``num_tokens`` tokens; False if the pool is short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` has filled since the last call."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block_id = seq.block_table[i]
            assert block_id != -1, f"seq {seq.seq_id} released block {i} before registering it"
            if self.enable_prefix_caching and h not in self.hash_to_block and self.block_hash[block_id] is None:
                self.hash_to_block[h] = block_id
                self.block_hash[block_id] = h
                self.block_tokens[block_id] = tokens

    def release_outside_window(self, seq: Sequence) -> None:
        """Release the blocks of ``seq`` wholly before the window of its next token, leaving -1 at
        their places (in place: the model runner keeps the ids it wrote, which the kernels never
        read there). Call it after ``cache_full_blocks``, so a shared prompt's blocks still hit."""
        if self.window is None:  # every step calls it: nothing to release without a window
            return
        bs = self.block_size
        position = seq.num_computed_tokens
        if seq.num_forks:  # children still to fork start from the last block boundary (fork): keep what they read
            position -= position % bs
        table = seq.block_table
        stop = min(self.window_start_block(position), len(table))
        assert stop <= len(seq.block_hashes), f"seq {seq.seq_id} would release blocks it has not registered"
        start = stop
        while start > 0 and table[start - 1] != -1:  # the released places are a prefix of the table
            start -= 1
        for i in range(start, stop):  # oldest first: it is evicted first
            self._release(table[i])
            table[i] = -1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full blocks with ``child``; the child recomputes the partial tail.

        Should the parent have released a block the window of the child's first token reads, the
        child shares nothing and recomputes its prompt (the scheduler keeps those blocks until the
        fork, so this is a safety net)."""
        num_full = min(parent.num_computed_tokens // self.block_size, len(parent.block_hashes))
        if -1 in parent.block_table[self.window_start_block(num_full * self.block_size) : num_full]:
            num_full = 0
        child.block_table = parent.block_table[:num_full]
        child.block_hashes = parent.block_hashes[:num_full]
        for block_id in child.block_table:
            if block_id != -1:
                self.ref_counts[block_id] += 1
        child.num_computed_tokens = num_full * self.block_size

    def free_blocks(self, seq: Sequence) -> None:
        # tail first, so a prompt's later blocks are evicted before its shared start
        for block_id in reversed(seq.block_table):
            if block_id != -1:  # released already
                self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unused block joins the free queue still cached, where its hash says
        it holds something reusable (most recently used end), else first in line."""
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None
            if self.block_hash[block_id] is None:
                self.free.move_to_end(block_id, last=False)

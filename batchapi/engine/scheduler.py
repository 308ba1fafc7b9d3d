"""Which sequences advance in the next step, and by how many tokens.

Plain Python (no torch). One rule, as in vLLM V1: each sequence's ``num_computed_tokens``
catches up with its ``num_tokens`` under a per-step token budget. A prompt is a sequence far
behind (chunked if the budget is short), a decode is one token behind, and both mix in one
step. Running sequences go first, then waiting ones; when blocks run out the most recently
admitted sequence is preempted and later recomputed.

Under a sliding window (every layer's), each step's update releases the blocks that have left the
window of a sequence's next token, so a long generation holds about a window of blocks; growth,
admission and preemption count only the blocks a sequence still has to take.

Prefix reuse is token-exact, not only block-exact: after the full cached blocks a new sequence
reuses, the start of its next block is copied from a running sequence holding the same tokens
there (a shared system prompt rarely ends on a block boundary). The copy is a ``KVCopy`` the
model runs in every layer after storing the step's keys and values and before attention, so
the donor may be computing those tokens in the same step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from batchapi.engine.block_manager import BlockManager, chain_hash
from batchapi.engine.request import ErrorCode
from batchapi.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class KVCopy:
    """Copy the KV of the first ``num_tokens`` slots of block ``src`` into block ``dst``.

    Copies of a higher ``wave`` run after those of lower ones: a wave-1 copy reads a block that
    a wave-0 copy of the same step fills."""

    src: int
    dst: int
    num_tokens: int
    wave: int = 0


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    kv_copies: list[KVCopy] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class WaitingQueue:
    """FIFO of waiting sequences, grouped by the start of their prompt.

    A new sequence joins the group of earlier ones that share its first ``key_len`` tokens,
    so shared system prompts and few-shot blocks run back to back and hit the prefix cache.
    Preempted sequences go first of all.
    """

    def __init__(self, key_len: int):
        self.key_len = key_len
        self.front: deque[Sequence] = deque()
        self.groups: OrderedDict[tuple[int, ...], deque[Sequence]] = OrderedDict()
        self.size = 0

    def key(self, seq: Sequence) -> tuple[int, ...]:
        return tuple(seq.token_ids[: min(self.key_len, seq.num_prompt_tokens)])

    def push(self, seq: Sequence) -> None:
        self.groups.setdefault(self.key(seq), deque()).append(seq)
        self.size += 1

    def push_front(self, seq: Sequence) -> None:
        self.front.appendleft(seq)
        self.size += 1

    def pop(self) -> Sequence:
        self.size -= 1
        if self.front:
            return self.front.popleft()
        key = next(iter(self.groups))
        group = self.groups[key]
        seq = group.popleft()
        if not group:
            del self.groups[key]
        return seq

    def take_front(self, group: deque[Sequence], count: int) -> None:
        """Drop the first ``count`` sequences of ``group`` (one of ``runs()``): those admitted.
        O(count), where removing each by value would scan the group (a shared system prompt makes
        one group of a whole batch)."""
        for _ in range(count):
            group.popleft()
        self.size -= count
        if not group and group is not self.front:
            key = next((k for k, g in self.groups.items() if g is group), None)  # the groups admitted from are first
            if key is not None:
                del self.groups[key]

    def take(self, group: deque[Sequence], taken: list[Sequence]) -> None:
        """Drop ``taken`` (admitted, in group order) from ``group``: its first sequences, or some of
        them where others were left to wait a step. O(the part of the group they span)."""
        span = 0
        while span < len(taken) and group[span] is taken[span]:
            span += 1
        if span == len(taken):
            self.take_front(group, span)
            return
        ids = {id(seq) for seq in taken}
        kept = []
        seen = 0
        while seen < len(taken):
            seq = group.popleft()
            if id(seq) in ids:
                seen += 1
            else:
                kept.append(seq)
        group.extendleft(reversed(kept))
        self.size -= len(taken)
        if not group and group is not self.front:
            key = next((k for k, g in self.groups.items() if g is group), None)
            if key is not None:
                del self.groups[key]

    def remove(self, seq: Sequence) -> None:
        if seq in self.front:
            self.front.remove(seq)
        else:
            key = self.key(seq)
            self.groups[key].remove(seq)
            if not self.groups[key]:
                del self.groups[key]
        self.size -= 1

    def __len__(self) -> int:
        return self.size

    def runs(self) -> Iterator[deque[Sequence]]:
        """The preempted sequences, then each prefix group, in order."""
        yield self.front
        yield from self.groups.values()

    def __iter__(self) -> Iterator[Sequence]:
        yield from self.front
        for group in self.groups.values():
            yield from group


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, scores=None):
        """``scores``: the prompt scores cache (``prompt_scores.ScoreCache``): a request that wants
        prompt logprobs takes a prefix hit only as far as its blocks have scores."""
        self.bm = block_manager
        self.scores = scores
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(key_len=4 * block_manager.block_size)
        self.running: list[Sequence] = []
        self.rejected: list[Sequence] = []  # finished with an error at admission, reported next step
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens == 0:
            seq.fail(ErrorCode.PROMPT_EMPTY, "the prompt is empty")
        elif seq.num_tokens > self.max_model_len or (seq.num_tokens == self.max_model_len
                                                     and getattr(seq.params, "max_tokens", 1) != 0):  # 0: scored only
            seq.fail(ErrorCode.PROMPT_TOO_LONG, f"the prompt has {seq.num_tokens} tokens; this engine holds at most "
                                                f"{self.max_model_len} tokens per sequence, output included")
        if seq.is_finished:
            self.rejected.append(seq)
            return
        self.waiting.push(seq)

    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting) or self.rejected)

    def abort(self, request_id: str) -> list[Sequence]:
        found = [s for s in self.running if s.request_id == request_id]
        self.running = [s for s in self.running if s.request_id != request_id]
        waiting = [s for s in self.waiting if s.request_id == request_id]
        for seq in waiting:
            self.waiting.remove(seq)
        for seq in found:
            self.bm.free_blocks(seq)
        return found + waiting

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        if not preempted:
            self._schedule_waiting(batch, budget - batch.num_tokens)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert n > 0, f"running seq {seq.seq_id} has nothing to compute"
            while not self.bm.grow(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return preempted
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        return preempted

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        admitted: list[tuple[deque[Sequence], list[Sequence]]] = []  # (group, the sequences admitted from it)
        pending: set[int] = set()  # hashes of the prompt blocks that this step's admissions compute
        full = False  # out of budget, seq slots or blocks: admit nothing more this step
        scheduled = dict(zip(batch.seqs, batch.num_new_tokens, strict=True))  # seq -> tokens it computes now
        waves: dict[int, int] = {}  # block filled by a copy this step -> the copy's wave
        forks = sum(s.num_forks for s in self.running)  # children that running parents (n > 1) fork yet
        for group in self.waiting.runs():
            taken: list[Sequence] = []
            deferred = 0
            for seq in group:
                if budget <= 0 or not self._has_seq_slot(seq, forks):
                    full = True
                    break
                cached, hashes = self.bm.match_prefix(seq)
                if _scored(seq) and self.scores is not None:  # its hits need their prompt scores
                    known = self.scores.known(hashes)
                    known = known if known == len(hashes) or self.bm.window is None else 0
                    cached, hashes = cached[:known], hashes[:known]
                if pending and group is not self.waiting.front and self._computed_now(seq, hashes, pending):
                    # its next blocks are being computed now: next step they are cache hits. Later
                    # sequences of the group may differ sooner (the next question after a shared
                    # few-shot prefix): look a little further for them
                    deferred += 1
                    if deferred > self.max_num_seqs:
                        break
                    continue
                num_cached = len(cached) * self.bm.block_size
                donor = (self._find_donor(seq, num_cached, scheduled, waves)
                         if self.bm.enable_prefix_caching and not _scored(seq) else None)
                copied = donor[1] if donor else 0
                n = min(seq.num_tokens - num_cached - copied, budget)
                if not self.bm.can_admit(cached, num_cached + copied + n):
                    full = True
                    break
                self._admit(seq, cached, hashes, num_cached + copied, n, batch)
                forks += seq.num_forks
                scheduled[seq] = n
                if donor:
                    src, _, wave = donor
                    batch.kv_copies.append(KVCopy(src, seq.block_table[len(cached)], copied, wave))
                    waves[seq.block_table[len(cached)]] = wave
                taken.append(seq)
                budget -= n
                if self.bm.enable_prefix_caching:
                    pending.update(self.bm.prompt_hashes(seq, len(hashes), hashes[-1] if hashes else None))
            if taken:
                admitted.append((group, taken))
            if full:
                break
        for group, taken in admitted:
            self.waiting.take(group, taken)

    def _find_donor(self, seq: Sequence, num_cached: int, scheduled: dict[Sequence, int],
                    waves: dict[int, int]) -> tuple[int, int, int] | None:
        """(block, tokens, wave) of the longest run of ``seq``'s next tokens that a running
        sequence holds at the same place, or None. A donor's tokens count if computed before
        this step or in it; tokens it received by a copy this step are read one wave later."""
        bs = self.bm.block_size
        start = num_cached  # a block boundary: the first token past the cache hits
        limit = min(start + bs, seq.num_tokens - 1)  # leave a token to compute: its logits are needed
        if limit <= start:
            return None
        want = seq.token_ids[start:limit]
        best, best_len = None, 0
        for donor in self.running:
            if donor.num_tokens <= start or donor.token_ids[start] != want[0] or len(donor.block_table) <= start // bs:
                continue
            if donor.block_table[start // bs] == -1:
                continue  # released: the block may hold another sequence's tokens now
            have = donor.token_ids[start : min(donor.num_computed_tokens + scheduled.get(donor, 0), start + bs)]
            m = next((i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b), min(len(have), len(want)))
            if m > best_len and donor.token_ids[:start] == seq.token_ids[:start]:
                best, best_len = donor.block_table[start // bs], m
        return None if best is None else (best, best_len, waves.get(best, -1) + 1)

    def _computed_now(self, seq: Sequence, hashes: list[int], pending: set[int]) -> bool:
        """Whether the first block of ``seq`` past its cache hits is one this step computes."""
        bs = self.bm.block_size
        start = len(hashes)
        if (start + 1) * bs > seq.num_prompt_tokens:
            return False
        block = tuple(seq.token_ids[start * bs : (start + 1) * bs])
        return chain_hash(hashes[-1] if hashes else None, block) in pending

    def _admit(self, seq: Sequence, cached: list[int], hashes: list[int], num_cached: int, n: int,
               batch: ScheduledBatch) -> None:
        """Admit ``seq`` with its first ``num_cached`` tokens reused: ``cached`` blocks, then any
        tokens the caller copies into its next block."""
        self.bm.admit(seq, cached, hashes, num_cached + n)
        seq.num_computed_tokens = num_cached
        if seq.num_output_tokens == 0:  # first admission, not a recompute after preemption
            seq.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)

    def _has_seq_slot(self, seq: Sequence, forks: int) -> bool:
        """Whether ``seq`` and the children it forks fit beside the running sequences and the
        children those fork later (``forks``)."""
        return not self.running or len(self.running) + forks + 1 + seq.num_forks <= self.max_num_seqs

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq)
        self.num_preemptions += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` (n > 1) on the blocks of ``parent``, whose prompt is computed."""
        self.bm.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def postprocess(self, batch: ScheduledBatch) -> None:
        """Advance the computed counts of a step's sequences and release the blocks that left their
        window (registered first, so a shared prompt still hits); ``release_finished`` follows."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is SequenceStatus.WAITING:
                continue  # aborted or preempted meanwhile
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            self.bm.release_outside_window(seq)

    def release_finished(self) -> None:
        done = [s for s in self.running if s.is_finished]
        if done:
            self.running = [s for s in self.running if not s.is_finished]
            for seq in done:
                self.bm.free_blocks(seq)


def _scored(seq: Sequence) -> bool:
    """Whether ``seq`` wants its prompt's logprobs (``engine.prompt_scores``)."""
    return getattr(seq.params, "prompt_logprobs", None) is not None

"""Prompt logprobs: the logprob of each prompt token under the model, computed in the prefill.

A request with ``SamplingParams.prompt_logprobs`` (``k``: how many alternatives, 0-20) gets, for
every prompt token after the first, its logprob and the ``k`` most likely tokens at its place,
from the logits of the position before it. The forward keeps the final hidden states of the
prompt positions a step computes (``CausalLM.forward(hidden_rows=...)``) and ``score`` turns
them into logprobs ``SCORE_ROWS`` rows at a time, so the vocabulary-sized rows of a long prompt
never sit in memory together; each row goes through the same batch-invariant ``lm_head`` and an
fp32 ``log_softmax``, so a token's logprob does not depend on what else ran beside it.

Requests that share a context (the choices of one question, a few-shot prefix) share its KV
through the prefix cache, and its scores through ``ScoreCache``: a full prompt block, keyed by
the same chained hash, keeps the scores of its tokens after the first (their sources lie in the
block) and the hidden state of its last position, which scores the first token of whatever block
follows. The scheduler takes a prefix hit for such a request only as far as its blocks have
scores (``ScoreCache.known``), and copies no partial block into it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from batchapi.engine.block_manager import chain_hash
from batchapi.engine.request import TokenLogprob
from batchapi.engine.sequence import Sequence

TOP = 20  # alternatives computed and cached for every scored token: any k up to it is served


@dataclass(frozen=True)
class BlockScores:
    logprobs: np.ndarray  # [bs - 1] float32: tokens 1..bs-1 of the block
    top_ids: np.ndarray  # [bs - 1, TOP] int64
    top_logprobs: np.ndarray  # [bs - 1, TOP] float32
    hidden: torch.Tensor  # [H]: the block's last position, final norm applied
    # the scores of tokens that followed the block, by token: (logprob, top ids, top logprobs)
    after: dict[int, tuple] = field(default_factory=dict)


class ScoreCache:
    """Scores of full prompt blocks by chained hash, least recently used dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict[int, BlockScores] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def known(self, hashes: list[int]) -> int:
        """How many of the leading ``hashes`` have scores."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def get(self, h: int) -> BlockScores:
        self._blocks.move_to_end(h)
        return self._blocks[h]

    def put(self, h: int, scores: BlockScores) -> None:
        self._blocks[h] = scores
        self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


@torch.inference_mode()
def score(model, hidden: torch.Tensor, targets: torch.Tensor, rows: int) -> tuple[np.ndarray, ...]:
    """hidden [R, H] final normed states, targets [R] the token after each (-1: none) ->
    (logprob of each target [R], top ids [R, TOP], top logprobs [R, TOP]) on the host, computed
    ``rows`` rows at a time."""
    lps, ids, tops = [], [], []
    for i in range(0, len(hidden), rows):
        logprobs = torch.log_softmax(model.logits(hidden[i: i + rows]).float(), dim=-1)  # [r, V]
        target = targets[i: i + rows].clamp(min=0)
        lps.append(logprobs.gather(1, target[:, None])[:, 0])
        top = torch.topk(logprobs, min(TOP, logprobs.shape[1]), dim=-1)
        ids.append(top.indices)
        tops.append(top.values)
    return (torch.cat(lps).cpu().numpy(), torch.cat(ids).cpu().numpy(), torch.cat(tops).cpu().numpy())


def prompt_hashes(seq: Sequence, block_size: int) -> list[int]:
    """The chained hashes of ``seq``'s full prompt blocks (the prefix cache's), computed once."""
    if seq.prompt_hashes is None:
        hashes, prev = [], None
        for i in range(seq.num_prompt_tokens // block_size):
            prev = chain_hash(prev, tuple(seq.token_ids[i * block_size: (i + 1) * block_size]))
            hashes.append(prev)
        seq.prompt_hashes = hashes
    return seq.prompt_hashes


def entry(token: int, logprob: float, ids, logprobs, k: int) -> TokenLogprob:
    return TokenLogprob(token, float(logprob), [(int(t), float(lp)) for t, lp in zip(ids[:k], logprobs[:k],
                                                                                    strict=True)])


class PromptScorer:
    """A step's prompt scoring: which hidden rows the forward keeps, and where their scores go."""

    def __init__(self, model, cache: ScoreCache, block_size: int, rows: int, device: torch.device):
        self.model, self.cache, self.bs, self.rows, self.device = model, cache, block_size, rows, device

    def plan(self, seqs: list[Sequence], num_new_tokens: list[int], cu: np.ndarray) -> tuple | None:
        """(hidden rows [R] on the device, [(seq, position)] of each row) for the prompt positions this
        step computes of requests that want prompt logprobs; None when none do. Scores a hit's
        cached blocks on the way (a sequence's first step)."""
        rows, owners = [], []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            if seq.params.prompt_logprobs is None or seq.sample_index or seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue
            start, prompt = seq.num_computed_tokens, seq.num_prompt_tokens
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * prompt
            self._from_cache(seq, start)
            for p in range(start, min(start + n, prompt)):
                if p < prompt - 1 or (p + 1) % self.bs == 0:  # scores the next token, or closes a block
                    rows.append(int(cu[i]) + p - start)
                    owners.append((seq, p))
        if not owners:
            return None
        return torch.tensor(rows, dtype=torch.int64, device=self.device), owners

    def finish(self, hidden: torch.Tensor, owners: list[tuple[Sequence, int]]) -> None:
        """Score the rows the forward kept, and cache the prompt blocks they completed."""
        targets = [seq.token_ids[p + 1] if p + 1 < seq.num_prompt_tokens else -1 for seq, p in owners]
        lps, ids, tops = score(self.model, hidden, torch.tensor(targets, device=hidden.device), self.rows)
        for r, ((seq, p), target) in enumerate(zip(owners, targets, strict=True)):
            if target >= 0:
                seq.prompt_logprobs[p + 1] = entry(target, lps[r], ids[r], tops[r], seq.params.prompt_logprobs)
                seq.prompt_top[p + 1] = (ids[r], tops[r])
            if (p + 1) % self.bs == 0:
                self._cache_block(seq, (p + 1) // self.bs - 1, hidden[r])

    def _cache_block(self, seq: Sequence, block: int, hidden: torch.Tensor) -> None:
        first = block * self.bs
        tops = [seq.prompt_top.get(t) for t in range(first + 1, first + self.bs)]
        if any(t is None for t in tops):  # scored before a preemption dropped what it kept: not cached
            return
        scores = BlockScores(
            np.array([seq.prompt_logprobs[t].logprob for t in range(first + 1, first + self.bs)], dtype=np.float32),
            np.stack([ids for ids, _ in tops]), np.stack([lps for _, lps in tops]), hidden.clone())
        self.cache.put(prompt_hashes(seq, self.bs)[block], scores)

    def _from_cache(self, seq: Sequence, start: int) -> None:
        """Fill the scores of the first ``start`` prompt tokens (a prefix hit) from the cache."""
        if start == 0 or seq.prompt_logprobs[start] is not None:
            return
        hashes, k, bs = prompt_hashes(seq, self.bs), seq.params.prompt_logprobs, self.bs
        boundary, targets = [], []
        for b in range(start // bs):
            block = self.cache.get(hashes[b])
            for j in range(1, bs):
                t = b * bs + j
                seq.prompt_logprobs[t] = entry(seq.token_ids[t], block.logprobs[j - 1], block.top_ids[j - 1],
                                               block.top_logprobs[j - 1], k)
                seq.prompt_top[t] = (block.top_ids[j - 1], block.top_logprobs[j - 1])
            if (b + 1) * bs < seq.num_prompt_tokens:  # the next block's first token, scored from this block's end
                target = seq.token_ids[(b + 1) * bs]
                if target in block.after:  # scored for an earlier request
                    self._put(seq, (b + 1) * bs, target, *block.after[target])
                else:
                    boundary.append((b, block))
        if boundary:
            targets = [seq.token_ids[(b + 1) * bs] for b, _ in boundary]
            lps, ids, tops = score(self.model, torch.stack([block.hidden for _, block in boundary]),
                                   torch.tensor(targets, device=self.device), self.rows)
            for r, ((b, block), target) in enumerate(zip(boundary, targets, strict=True)):
                block.after[target] = (lps[r], ids[r], tops[r])
                self._put(seq, (b + 1) * bs, target, lps[r], ids[r], tops[r])

    def _put(self, seq: Sequence, t: int, token: int, logprob, ids, tops) -> None:
        seq.prompt_logprobs[t] = entry(token, logprob, ids, tops, seq.params.prompt_logprobs)
        seq.prompt_top[t] = (ids, tops)

"""Pick the next token of every row of a step from its logits.

Order per row: logit_bias, presence/frequency penalties (over the row's output tokens), the
grammar's token mask (structured outputs: disallowed tokens to -inf), then temperature, min_p,
top_k, top_p, then the draw. Logprobs are those of the raw model distribution
(log-softmax of the unmodified logits), as OpenAI and vLLM report them.

The draw is by inverse CDF: one uniform number per row, looked up in the cumulative sum of the
row's filtered probabilities. A seeded row takes its number from a hash of (seed, sample_index,
step), so its tokens never depend on what else is in the batch; unseeded rows share one generator.
This costs one cumsum per row, where the exponential race (argmax(p / Exp noise)) would need a
random draw and a log for every vocabulary entry, about ten times slower on CPU.

Filters are thresholds on probability (keep p >= t), so tied tokens at a top_k/top_p boundary are
all kept and the kept set does not depend on how a sort orders ties.

Speed on CPU: rows are regrouped (greedy, then by which filters they use) so every subset is a
contiguous block of one scratch tensor, worked on in place; the [B, V] scratch tensors persist
across calls, since a fresh 50 MB tensor costs page faults worth several passes over it.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
import torch

from batchapi.engine.sampling_params import SamplingParams
from batchapi.grammar import apply_masks
from batchapi.kernels import TORCH_OPS, Ops

# top_p first looks for its cut among this many of the most likely tokens, then widens
TOP_P_CANDIDATES = (64, 512, 4096)


class OutputTokens(Sequence[int]):
    """The generated tokens of a sequence, read in place from its token list (no copy a step)."""

    __slots__ = ("_tokens", "_start")

    def __init__(self, tokens: list[int], start: int):
        self._tokens, self._start = tokens, start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, i):
        return self._tokens[self._start :][i]

    def __iter__(self) -> Iterator[int]:
        return islice(self._tokens, self._start, None)


@dataclass
class SampleRow:
    params: SamplingParams
    output_token_ids: Sequence[int]  # tokens generated so far (a list or OutputTokens); its length is the step number
    sample_index: int = 0  # which of the request's n samples, 0..n-1
    matcher: object | None = None  # grammar.Matcher: only the tokens it allows may be drawn
    forced: int | None = None  # the token this row takes whatever the logits say (a thinking marker)


@dataclass
class SampleOutput:
    token_id: int
    logprob: float | None = None  # set when params.logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # most likely first


class Sampler:
    def __init__(self, ops: Ops = TORCH_OPS, seed: int | None = None):
        """ops: the kernel set of the model runner; the sampler takes its greedy argmax and its
        token-bitmask apply (grammars)."""
        self._argmax = ops.argmax
        self._apply_bitmask = ops.apply_token_bitmask
        self._generator = torch.Generator()  # CPU: only one uniform per unseeded row comes from it
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._buffers: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleOutput]:
        """logits [B, V], any float dtype, on any device; one row per logits row. Not thread-safe."""
        return self.outputs(logits, rows, self.choose(logits, rows))

    @torch.inference_mode()
    def choose(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The token of each row -> [B] int64 on the logits' device. Greedy rows read nothing back
        from the device, so on CUDA this returns while the step still runs; ``outputs`` then waits."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (
            f"logits {tuple(logits.shape)} do not match {len(rows)} rows"
        )
        return self.with_forced(self._pick(logits, rows), rows)

    @staticmethod
    def argmax_only(rows: list[SampleRow]) -> bool:
        """Whether the rows' tokens are the logits' argmax and nothing else reads the logits: greedy,
        nothing modifying them (bias, penalties, a grammar), no logprobs. The model may then take the
        argmax in its lm_head and write no logits (CausalLM.greedy)."""
        return all(r.params.greedy and not _modifies_logits(r.params) and r.matcher is None
                   and not r.params.logprobs for r in rows)

    @staticmethod
    def with_forced(token_ids: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """token_ids with each row's forced token (a thinking marker) in its place."""
        forced = [(i, r.forced) for i, r in enumerate(rows) if r.forced is not None]
        if forced:  # its logprob stays the model's own: outputs() reads it from the raw logits
            at, tokens = zip(*forced, strict=True)
            token_ids[list(at)] = torch.tensor(tokens, dtype=token_ids.dtype).to(token_ids.device)
        return token_ids

    def _pick(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        plain_greedy = all(r.params.greedy and not _modifies_logits(r.params) for r in rows)
        matchers = [r.matcher for r in rows]
        if plain_greedy and all(m is None for m in matchers):
            return self._argmax(logits)  # fast path: nothing to apply
        if plain_greedy and not any(r.params.logprobs for r in rows):
            # greedy under grammars, no logprobs wanted: mask the logits in place (nothing reads
            # the raw ones again) rather than copy them to the fp32 scratch first
            apply_masks(logits, matchers, self._apply_bitmask)
            return self._argmax(logits)
        return self._choose(logits, rows)

    @torch.inference_mode()
    def outputs(self, logits: torch.Tensor, rows: list[SampleRow], token_ids: torch.Tensor) -> list[SampleOutput]:
        """The chosen tokens read back (the step's one wait on the device), with their logprobs."""
        return _outputs(logits, rows, token_ids.tolist())

    def _choose(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        order = sorted(range(len(rows)), key=lambda i: _group(rows[i].params, vocab))
        rows = [rows[i] for i in order]
        # temperature first, as the scratch copy (the raw logits stay for logprobs); bias and
        # penalties are then added divided by it: (x + b) / T == x / T + b / T
        scale = _column([1.0 if r.params.greedy else 1.0 / r.params.temperature for r in rows], logits)
        x = self._scaled_copy(logits, order, scale)  # [B, V] in `order`
        _apply_logit_bias(x, rows, scale)
        _apply_penalties(x, rows, scale)
        if any(r.matcher is not None for r in rows):
            apply_masks(x, [r.matcher for r in rows], self._apply_bitmask)  # one bitmask for the step's constrained rows
        num_greedy = sum(r.params.greedy for r in rows)
        chosen = torch.empty(len(rows), dtype=torch.long, device=x.device)
        if num_greedy:
            chosen[:num_greedy] = self._argmax(x[:num_greedy])
        if num_greedy < len(rows):
            chosen[num_greedy:] = self._sample(x[num_greedy:], rows[num_greedy:])
        token_ids = torch.empty_like(chosen)
        token_ids[_index(order, x.device)] = chosen
        return token_ids

    def _scaled_copy(self, logits: torch.Tensor, order: list[int], scale: torch.Tensor) -> torch.Tensor:
        """logits rows in ``order`` times ``scale`` [B], as fp32 in the persistent scratch [B, V]."""
        x = self._buffer("scratch", logits.shape, torch.float32, logits.device)
        # (index_select with out= is erratic on CPU, up to 50x slower than this copy)
        source = logits if order == list(range(len(order))) else logits[_index(order, logits.device)]
        return torch.mul(source, scale[:, None], out=x)

    def _sample(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """x [S, V] processed logits of non-greedy rows over temperature, overwritten -> token ids [S]."""
        # unnormalised probabilities with each row's largest at 1: the draw and every filter are
        # scale-free, and min_p's threshold is then min_p itself
        x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # amax: several times faster than max on CPU
        block = _block(rows, lambda p: p.min_p > 0)
        if block.stop > block.start:
            min_p = _column([r.params.min_p for r in rows[block]], x)
            self._zero_below(x[block], min_p)
        block = _block(rows, lambda p: _uses_top_k_top_p(p, x.shape[1]))
        if block.stop > block.start:
            self._apply_top_k_top_p(x[block], rows[block])
        return _inverse_cdf(x, self._uniforms(rows).to(x.device))

    def _apply_top_k_top_p(self, weights: torch.Tensor, rows: list[SampleRow]) -> None:
        """Keep each row's top_k most likely tokens, then the smallest head of those holding top_p of their mass."""
        vocab = weights.shape[1]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_k = torch.tensor(top_k, dtype=torch.long, device=weights.device)
        top_p = _column([r.params.top_p for r in rows], weights)
        self._zero_below(weights, _keep_thresholds(weights, top_k, top_p))

    def _zero_below(self, weights: torch.Tensor, threshold: torch.Tensor) -> None:
        """weights [F, V] in place: zero every entry under its row's threshold [F]."""
        below = self._buffer("mask", weights.shape, torch.bool, weights.device)
        torch.lt(weights, threshold[:, None], out=below)
        weights.masked_fill_(below, 0.0)

    def _buffer(self, name: str, shape: torch.Size | tuple[int, ...], dtype, device) -> torch.Tensor:
        """A view of a tensor kept across calls, grown when a call needs more."""
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)

    def _uniforms(self, rows: list[SampleRow]) -> torch.Tensor:
        """One number in [0, 1) per row [S] float64: seeded rows from their hash, others from the generator."""
        u = torch.rand(len(rows), dtype=torch.float64, generator=self._generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                u[i] = seeded_uniform(r.params.seed, r.sample_index, len(r.output_token_ids))
        return u


def seeded_uniform(seed: int, sample_index: int, step: int) -> float:
    """A number in [0, 1) that depends only on its arguments (stable across processes and machines)."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, sample_index, step), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def _modifies_logits(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.has_penalties


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def _uses_top_k_top_p(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _group(params: SamplingParams, vocab: int) -> int:
    """Sort key that makes greedy rows, min_p rows and top_k/top_p rows each one contiguous block."""
    if params.greedy:
        return 0
    min_p, top = params.min_p > 0, _uses_top_k_top_p(params, vocab)
    return 1 + [(False, False), (True, False), (True, True), (False, True)].index((min_p, top))


def _block(rows: list[SampleRow], wanted) -> slice:
    """The slice of ``rows`` whose params satisfy ``wanted``; rows are grouped so it is one block."""
    hits = [i for i, r in enumerate(rows) if wanted(r.params)]
    if not hits:
        return slice(0, 0)
    assert hits[-1] - hits[0] + 1 == len(hits), "rows must be grouped by filter (see _group)"
    return slice(hits[0], hits[-1] + 1)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _apply_logit_bias(x: torch.Tensor, rows: list[SampleRow], scale: torch.Tensor) -> None:
    """Add each row's logit_bias times its ``scale`` [B] to x [B, V]."""
    row_ids, token_ids, biases = [], [], []
    for i, r in enumerate(rows):
        for token, bias in r.params.logit_bias.items():
            # a token past the vocabulary can never be drawn, so its bias means nothing; the
            # engine rejects such requests up front (SamplingParams.check_vocab), a step must not raise
            if token < x.shape[1]:
                row_ids.append(i)
                token_ids.append(token)
                biases.append(bias)
    if not row_ids:
        return
    row_ids = _index(row_ids, x.device)
    biases = _column(biases, x) * scale[row_ids]
    x.index_put_((row_ids, _index(token_ids, x.device)), biases, accumulate=True)


def _apply_penalties(x: torch.Tensor, rows: list[SampleRow], scale: torch.Tensor | None = None) -> None:
    """OpenAI's formula: logit[j] -= frequency * count[j] + presence * (count[j] > 0), output tokens only.

    The penalty is multiplied by the row's ``scale`` [B], if given."""
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties and r.output_token_ids]
    if not penalised:
        return
    vocab = x.shape[1]
    # count (row, token) pairs as row * vocab + token: work in the number of output tokens, not B * V,
    # and in whole-array ops (a row's tokens are copied out of its list in C, never looped over)
    flat = np.concatenate([np.fromiter(rows[i].output_token_ids, dtype=np.int64) + i * vocab
                           for i in penalised])
    pairs, counts = torch.unique(torch.from_numpy(flat).to(x.device), return_counts=True)
    row_ids, token_ids = pairs // vocab, pairs % vocab
    frequency = _column([r.params.frequency_penalty for r in rows], x)[row_ids]
    presence = _column([r.params.presence_penalty for r in rows], x)[row_ids]
    penalty = frequency * counts + presence
    x[row_ids, token_ids] -= penalty if scale is None else penalty * scale[row_ids]


def _keep_thresholds(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [F, V] (may be unnormalised), top_k [F] (V when off), top_p [F] -> the smallest kept value per row [F].

    A full sort of the vocabulary is slow on CPU, so each row's cut is looked for among the
    K most likely tokens (torch.topk), widening K only for rows whose cut lies beyond it."""
    vocab = probs.shape[1]
    threshold = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    total = probs.sum(dim=-1)
    pending = torch.arange(probs.shape[0], device=probs.device)
    for cap in (*TOP_P_CANDIDATES, vocab):
        # enough columns for the widest top_k still pending, up to this level's cap
        k = min(vocab, cap, int(top_k[pending].max()))
        rows = probs if len(pending) == probs.shape[0] else probs[pending]
        done, cut = _cut_among_top(rows, total[pending], top_k[pending], top_p[pending], k)
        threshold[pending[done]] = cut[done]
        pending = pending[~done]
        if len(pending) == 0:
            break
    assert len(pending) == 0, "the full-vocabulary pass must place every row's cut"
    return threshold


def _cut_among_top(
    probs: torch.Tensor, row_total: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look for each row's cut among its k most likely tokens -> (found [F] bool, threshold [F])."""
    vocab = probs.shape[1]
    values = probs.topk(k, dim=-1).values  # [F, k], descending
    in_top_k = torch.arange(k, device=probs.device)[None, :] < top_k[:, None]
    values = values * in_top_k
    cumulative = values.cumsum(dim=-1)  # [F, k]
    top_k_inside = top_k <= k
    # mass to cover: all of the top_k tokens when they are all here, else the whole row's
    total = torch.where(top_k_inside, cumulative[:, -1], row_total)
    target = top_p * total
    # keep a token while the mass before it is short of the target; top_p == 1 keeps all top_k
    keep = ((cumulative - values) < target[:, None]) & in_top_k
    keep = torch.where((top_p >= 1)[:, None], in_top_k, keep)
    num_kept = keep.sum(dim=-1).clamp(min=1)
    found = top_k_inside | ((top_k == vocab) & (cumulative[:, -1] >= target) & (top_p < 1))
    cut = values.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    return found, cut


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [S, V] (unnormalised, zeros never drawn; overwritten), u [S] in [0, 1) -> token ids [S]."""
    cdf = weights.cumsum_(dim=-1)  # [S, V]
    total = cdf[:, -1]
    target = (u * total.double()).to(cdf.dtype)
    # rounding may lift u * total to total, past the last drawable token; stay just below it
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    token_ids = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    # only NaN weights (a broken model) lead past the end; keep the id valid rather than crash the step
    return token_ids.clamp_(max=weights.shape[1] - 1)


def _outputs(logits: torch.Tensor, rows: list[SampleRow], token_ids: list[int]) -> list[SampleOutput]:
    outputs = [SampleOutput(token_id=t) for t in token_ids]
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
    if not wanted:
        return outputs
    raw = logits if len(wanted) == len(rows) else logits[_index(wanted, logits.device)]
    logprobs = torch.log_softmax(raw.float(), dim=-1)  # [L, V] of the unmodified model logits
    chosen = logprobs.gather(1, _index([token_ids[i] for i in wanted], raw.device)[:, None])
    chosen = chosen.squeeze(1).tolist()
    num_top = max(rows[i].params.top_logprobs for i in wanted)
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for k, i in enumerate(wanted):
        outputs[i].logprob = chosen[k]
        n = rows[i].params.top_logprobs
        if n:
            outputs[i].top_logprobs = list(zip(top_ids[k][:n], top_values[k][:n], strict=True))
    return outputs

"""Pick the next token of every row of a step from its logits.

Order per row: logit_bias, presence/frequency penalties (over the row's output tokens), then
temperature, min_p, top_k, top_p, then the draw. Logprobs are those of the raw model distribution
(log-softmax of the unmodified logits), as OpenAI and vLLM report them.

The draw is by inverse CDF: one uniform number per row, looked up in the cumulative sum of the
row's filtered probabilities. A seeded row takes its number from a hash of (seed, sample_index,
step), so its tokens never depend on what else is in the batch; unseeded rows share one generator.
This costs one cumsum per row, where the exponential race (argmax(p / Exp noise)) would need a
random draw and a log for every vocabulary entry, about ten times slower on CPU.

Filters are thresholds on probability (keep p >= t), so tied tokens at a top_k/top_p boundary are
all kept and the kept set does not depend on how a sort orders ties.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import torch

from batchapi.engine.sampling_params import SamplingParams

# top_p first looks for its cut among this many of the most likely tokens, then widens
TOP_P_CANDIDATES = (256, 4096)


@dataclass
class SampleRow:
    params: SamplingParams
    output_token_ids: list[int]  # tokens generated so far; its length is the step number
    sample_index: int = 0  # which of the request's n samples, 0..n-1


@dataclass
class SampleOutput:
    token_id: int
    logprob: float | None = None  # set when params.logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # most likely first


class Sampler:
    def __init__(self, seed: int | None = None):
        self._generator = torch.Generator()  # CPU: only one uniform per unseeded row comes from it
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleOutput]:
        """logits [B, V], any float dtype, on any device; one row per logits row."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (
            f"logits {tuple(logits.shape)} do not match {len(rows)} rows"
        )
        if all(r.params.greedy and not _modifies_logits(r.params) for r in rows):
            token_ids = logits.argmax(dim=-1)  # fast path: nothing to apply
        else:
            token_ids = self._choose(logits, rows)
        return _outputs(logits, rows, token_ids.tolist())

    def _choose(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        x = logits.to(torch.float32, copy=True)  # [B, V]; the caller's logits stay raw for logprobs
        _apply_logit_bias(x, rows)
        _apply_penalties(x, rows)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=x.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            idx = _index(greedy, x.device)
            token_ids[idx] = x[idx].argmax(dim=-1)
        if sampled:
            idx = _index(sampled, x.device)
            token_ids[idx] = self._sample(x[idx], [rows[i] for i in sampled])
        return token_ids

    def _sample(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """x [S, V] processed logits of non-greedy rows -> sampled token ids [S]."""
        temperature = _column([r.params.temperature for r in rows], x)
        probs = torch.softmax(x / temperature[:, None], dim=-1)  # [S, V]
        _apply_min_p(probs, rows)
        _apply_top_k_top_p(probs, rows)
        return _inverse_cdf(probs, self._uniforms(rows).to(x.device))

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


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _apply_logit_bias(x: torch.Tensor, rows: list[SampleRow]) -> None:
    row_ids, token_ids, biases = [], [], []
    for i, r in enumerate(rows):
        for token, bias in r.params.logit_bias.items():
            row_ids.append(i)
            token_ids.append(token)
            biases.append(bias)
    if not row_ids:
        return
    assert max(token_ids) < x.shape[1], (
        f"logit_bias token {max(token_ids)} outside vocab {x.shape[1]}; SamplingParams.check_vocab skipped"
    )
    index = (_index(row_ids, x.device), _index(token_ids, x.device))
    x.index_put_(index, _column(biases, x), accumulate=True)


def _apply_penalties(x: torch.Tensor, rows: list[SampleRow]) -> None:
    """OpenAI's formula: logit[j] -= frequency * count[j] + presence * (count[j] > 0), output tokens only."""
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties and r.output_token_ids]
    if not penalised:
        return
    vocab = x.shape[1]
    # one bincount for all rows: token t of the k-th penalised row counts at k * vocab + t
    flat = [k * vocab + t for k, i in enumerate(penalised) for t in rows[i].output_token_ids]
    counts = torch.bincount(_index(flat, x.device), minlength=len(penalised) * vocab)
    counts = counts.view(len(penalised), vocab).to(torch.float32)  # [P, V]
    frequency = _column([rows[i].params.frequency_penalty for i in penalised], x)
    presence = _column([rows[i].params.presence_penalty for i in penalised], x)
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0)
    idx = _index(penalised, x.device)
    x[idx] -= penalty


def _apply_min_p(probs: torch.Tensor, rows: list[SampleRow]) -> None:
    """Drop tokens less likely than min_p times the most likely one."""
    filtered = [i for i, r in enumerate(rows) if r.params.min_p > 0]
    if not filtered:
        return
    idx = _index(filtered, probs.device)
    sub = probs[idx]  # [F, V]
    min_p = _column([rows[i].params.min_p for i in filtered], probs)
    threshold = min_p * sub.max(dim=-1).values
    probs[idx] = sub.masked_fill(sub < threshold[:, None], 0.0)


def _apply_top_k_top_p(probs: torch.Tensor, rows: list[SampleRow]) -> None:
    """Keep each row's top_k most likely tokens, then the smallest head of those holding top_p of their mass."""
    vocab = probs.shape[1]
    filtered = [
        i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0
    ]
    if not filtered:
        return
    idx = _index(filtered, probs.device)
    sub = probs[idx]  # [F, V]
    top_k = torch.tensor(
        [rows[i].params.top_k if 0 < rows[i].params.top_k < vocab else vocab for i in filtered],
        dtype=torch.long, device=probs.device,
    )
    top_p = _column([rows[i].params.top_p for i in filtered], probs)
    threshold = _keep_thresholds(sub, top_k, top_p)
    probs[idx] = sub.masked_fill(sub < threshold[:, None], 0.0)


def _keep_thresholds(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [F, V], top_k [F] (V when off), top_p [F] -> the smallest kept probability per row [F].

    A full sort of the vocabulary is slow on CPU, so each row's cut is looked for among the
    K most likely tokens (torch.topk), widening K only for rows whose cut lies beyond it."""
    vocab = probs.shape[1]
    threshold = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    pending = torch.arange(probs.shape[0], device=probs.device)
    for cap in (*TOP_P_CANDIDATES, vocab):
        # enough columns for the widest top_k still pending, up to this level's cap
        k = min(vocab, cap, int(top_k[pending].max()))
        done, cut = _cut_among_top(probs[pending], top_k[pending], top_p[pending], k)
        threshold[pending[done]] = cut[done]
        pending = pending[~done]
        if len(pending) == 0:
            break
    assert len(pending) == 0, "the full-vocabulary pass must place every row's cut"
    return threshold


def _cut_among_top(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look for each row's cut among its k most likely tokens -> (found [F] bool, threshold [F])."""
    vocab = probs.shape[1]
    values = probs.topk(k, dim=-1).values  # [F, k], descending
    in_top_k = torch.arange(k, device=probs.device)[None, :] < top_k[:, None]
    values = values * in_top_k
    cumulative = values.cumsum(dim=-1)  # [F, k]
    top_k_inside = top_k <= k
    # mass to cover: all of the top_k tokens when they are all here, else the whole row's
    total = torch.where(top_k_inside, cumulative[:, -1], probs.sum(dim=-1))
    target = top_p * total
    # keep a token while the mass before it is short of the target; top_p == 1 keeps all top_k
    keep = ((cumulative - values) < target[:, None]) & in_top_k
    keep = torch.where((top_p >= 1)[:, None], in_top_k, keep)
    num_kept = keep.sum(dim=-1).clamp(min=1)
    found = top_k_inside | ((top_k == vocab) & (cumulative[:, -1] >= target) & (top_p < 1))
    cut = values.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    return found, cut


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [S, V] (unnormalised, zeros never drawn), u [S] in [0, 1) -> token ids [S]."""
    cdf = probs.cumsum(dim=-1)  # [S, V]
    total = cdf[:, -1]
    target = (u * total.double()).to(cdf.dtype)
    # rounding may lift u * total to total, past the last drawable token; stay just below it
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)


def _outputs(logits: torch.Tensor, rows: list[SampleRow], token_ids: list[int]) -> list[SampleOutput]:
    outputs = [SampleOutput(token_id=t) for t in token_ids]
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
    if not wanted:
        return outputs
    idx = _index(wanted, logits.device)
    logprobs = torch.log_softmax(logits[idx].float(), dim=-1)  # [L, V] raw model distribution
    chosen = logprobs.gather(1, _index([token_ids[i] for i in wanted], logits.device)[:, None])
    chosen = chosen.squeeze(1).tolist()
    num_top = max(rows[i].params.top_logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    for k, i in enumerate(wanted):
        outputs[i].logprob = chosen[k]
        n = rows[i].params.top_logprobs
        if n:
            outputs[i].top_logprobs = list(zip(top_ids[k, :n].tolist(), top_values[k, :n].tolist()))
    return outputs

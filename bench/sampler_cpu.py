"""CPU benchmark of the engine's Sampler against a vLLM-style peer (full sort, exponential race).

The peer is vLLM's native top-k/top-p path: sort the whole vocabulary when any row filters, then
draw argmax(p / Exponential noise), with a torch.Generator per seeded row. Prints ms per call for
both and the speed-up. Logits are synthetic with per-row sharpness, so nucleus sizes vary from a
handful of tokens to thousands, as in real decoding.
Usage: .venv/bin/python bench/sampler_cpu.py [--batch 256] [--vocab 49152] [--repeat 5]
"""

import argparse
import time

import torch

from batchapi.engine.sampler import Sampler, SampleRow
from batchapi.engine.sampling_params import SamplingParams
from batchapi.kernels import get_ops

CASES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "greedy + top_logprobs 5": lambda i: SamplingParams(temperature=0, logprobs=True, top_logprobs=5),
    "temperature 0.8": lambda i: SamplingParams(temperature=0.8),
    "top_p 0.95": lambda i: SamplingParams(top_p=0.95),
    "top_k 50": lambda i: SamplingParams(top_k=50),
    "seeded top_p 0.9": lambda i: SamplingParams(temperature=0.7, top_p=0.9, seed=i),
    "mixed": lambda i: [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(seed=i, top_k=40),
        SamplingParams(min_p=0.05, frequency_penalty=0.5),
    ][i % 4],
}


def make_logits(batch: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # nucleus (top_p 0.95) from ~4,000 tokens down to ~3, top-1 probability 0.1 to 0.7, as in real decoding
    sharpness = torch.linspace(3.0, 8.0, batch)[:, None]
    return torch.randn(batch, vocab, generator=g) * sharpness


def peer_sample(logits: torch.Tensor, rows: list[SampleRow], gen: torch.Generator) -> torch.Tensor:
    """vLLM-style: full log-softmax for logprobs; full sort when any row uses top_k or top_p."""
    num_top = max(r.params.top_logprobs for r in rows)
    if any(r.params.logprobs for r in rows):
        logprobs = logits.float().log_softmax(dim=-1)
        logprobs.topk(max(num_top, 1), dim=-1)
    if all(r.params.greedy for r in rows):
        return logits.argmax(dim=-1)
    x = logits.float().clone()
    greedy = torch.tensor([r.params.greedy for r in rows])
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows])
    x.div_(temps[:, None])
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else x.shape[1] for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows])
    if (top_k < x.shape[1]).any() or (top_p < 1).any():
        x = _peer_top_k_top_p(x, top_k, top_p)
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=gen)
    for i, r in enumerate(rows):
        if r.params.seed is not None:
            noise[i].exponential_(generator=torch.Generator().manual_seed(r.params.seed))
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _peer_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    values, order = x.sort(dim=-1)  # ascending
    kth = values.gather(1, (x.shape[1] - top_k)[:, None])
    values.masked_fill_(values < kth, float("-inf"))
    cumulative = values.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    values.masked_fill_(drop, float("-inf"))
    return values.scatter(1, order, values)


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    logits = make_logits(args.batch, args.vocab)
    sampler, gen = Sampler(get_ops("auto", "cpu"), seed=0), torch.Generator().manual_seed(0)  # the engine's CPU kernels
    print(f"batch {args.batch}, vocab {args.vocab}, {torch.get_num_threads()} threads; best of {args.repeat}")
    print(f"{'case':26s} {'sampler ms':>11s} {'peer ms':>9s} {'speed-up':>9s}")
    for name, make in CASES.items():
        rows = [SampleRow(make(i), list(range(i % 7, 40)), 0) for i in range(args.batch)]
        ours = best_ms(lambda: sampler(logits, rows), args.repeat)  # noqa: B023
        peer = best_ms(lambda: peer_sample(logits, rows, gen), args.repeat)  # noqa: B023
        print(f"{name:26s} {ours:11.1f} {peer:9.1f} {peer / ours:8.1f}x")


if __name__ == "__main__":
    main()

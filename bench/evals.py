"""An eval-shaped loglikelihood workload: this engine vs transformers, same run, same weights.

    .venv/bin/python bench/evals.py [--questions 24] [--prefix-tokens 320] [--stem-tokens 32]
        [--hf-batch-sizes 8,16] [--reference 32] [--threads N] [--dtype auto] [--skip hf,second]

Multiple-choice questions as an eval harness scores them (lm-eval's ``loglikelihood``): every
question has 4 choices, each a request of the shared 5-shot prefix (``--prefix-tokens``: five
worked examples of about a fifth of it each), the question's stem and the choice (1-8 tokens),
scored and not generated: ``SamplingParams(max_tokens=0, prompt_logprobs=1)``. A choice's score
is the sum of its tokens' logprobs; the picked answer is the best of the 4. Token ids are random
(the model's own vocabulary, no special tokens): the speed and the agreement do not depend on them.

(1) this engine (``LLMEngine``, the settings `auto` picks on this machine: bfloat16 where the CPU
has AVX512-BF16 or AMX), every request queued at once from an empty prefix cache, so the prefix
is computed by the first requests and served to the rest from the prefix cache (KV and scores),
and a question's stem from its first choice to the other three; (2) transformers on the same
weights and dtype, as lm-eval does it: the requests in padded batches (right padding, best of
``--hf-batch-sizes``), one forward, ``log_softmax`` over the logits in the model's dtype, the
continuation's logprobs gathered and summed. Prints requests/s of each (per CPU second of this
process over its threads, and per wall second), the ratio (from CPU time: stable on a shared
machine), the prefix-cache hit rate (cached prompt tokens / prompt tokens, from
``GenerationResult.cached_tokens``), and the agreement: the largest absolute difference between
the two sides' choice scores and the share of questions where both pick the same choice.

"The second run" (``--skip second`` leaves it out): the same requests through the same engine
again, its prefix cache warm. This is not a result cache (none is in the tree): it is what a
repeated run costs today, the baseline such a cache is measured against.

Printed, never asserted: timings are noisy on a shared CPU.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import Clock  # noqa: E402

from batchapi.engine import EngineConfig, GenerationRequest, LLMEngine, SamplingParams  # noqa: E402
from batchapi.models.store import resolve_model  # noqa: E402

CHOICES = 4
SHOTS = 5
# max |engine - transformers| of a choice's logprob sum (1-8 tokens). bfloat16: transformers' own
# log_softmax in bf16 rounds a logprob near -11 (random tokens of a 49k vocabulary) to steps of 1/16,
# up to 8 of them a choice, on top of two bf16 forwards that round differently (--reference shows
# each side's distance to float32)
TOLERANCE = {torch.bfloat16: 1.0, torch.float32: 1e-3}


@dataclass
class Item:
    context: list[int]  # prefix + stem
    choice: list[int]


def build_items(vocab: int, questions: int, prefix_tokens: int, stem_tokens: int, seed: int) -> list[Item]:
    """questions x CHOICES requests: a shared prefix of SHOTS worked examples, a stem, a choice."""
    rng = random.Random(seed)
    low = 16  # below: special tokens in SmolLM2's vocabulary

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    shot = prefix_tokens // SHOTS
    prefix = [t for _ in range(SHOTS) for t in tokens(shot)] + tokens(prefix_tokens - shot * SHOTS)
    items = []
    for _ in range(questions):
        context = prefix + tokens(rng.randint(stem_tokens // 2, stem_tokens * 3 // 2))
        items.extend(Item(context, tokens(rng.randint(1, 8))) for _ in range(CHOICES))
    return items


@dataclass
class Run:
    scores: list[float]  # per item: the choice's logprob sum
    wall: float
    cpu: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    label: str = ""

    def __str__(self) -> str:
        n = len(self.scores)
        return f"{n / self.cpu:8.1f} requests/s ({n / self.wall:.1f} per wall second, {n} requests)"


# ---- this engine ----

def run_engine(engine: LLMEngine, items: list[Item], reset: bool = True) -> Run:
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1)
    if reset:
        engine.block_manager.reset_prefix_cache()
    scores: list[float] = [0.0] * len(items)
    prompt = cached = 0
    with Clock() as clock:
        for i, item in enumerate(items):
            engine.add_request(GenerationRequest(str(i), item.context + item.choice, params))
        while engine.has_unfinished():
            for result in engine.step():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                i = int(result.request_id)
                start = len(items[i].context)
                scores[i] = sum(e.logprob for e in result.prompt_logprobs[start:])
                prompt += result.prompt_tokens
                cached += result.cached_tokens
    return Run(scores, clock.wall, clock.cpu, prompt, cached)


# ---- transformers ----

def run_hf(model, items: list[Item], batch: int, pad: int) -> Run:
    scores: list[float] = [0.0] * len(items)
    order = sorted(range(len(items)), key=lambda i: -len(items[i].context) - len(items[i].choice))  # as lm-eval
    with Clock() as clock, torch.inference_mode():
        for lo in range(0, len(order), batch):
            group = order[lo : lo + batch]
            rows = [items[i].context + items[i].choice for i in group]
            width = max(map(len, rows))
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, dim=-1)
            for row, i in enumerate(group):
                start, end = len(items[i].context), len(rows[row])
                target = ids[row, start:end]
                picked = logprobs[row, start - 1 : end - 1].gather(-1, target[:, None])
                scores[i] = picked.float().sum().item()
    return Run(scores, clock.wall, clock.cpu)


def agreement(a: list[float], b: list[float]) -> tuple[float, float]:
    """The largest |a - b| over the choices, and the share of questions where both pick the same."""
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    questions = len(a) // CHOICES
    same = 0
    for q in range(questions):
        sl = slice(q * CHOICES, (q + 1) * CHOICES)
        same += max(range(CHOICES), key=lambda c: a[sl][c]) == max(range(CHOICES), key=lambda c: b[sl][c])
    return diff, same / questions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=24, help="4 requests each")
    ap.add_argument("--prefix-tokens", type=int, default=320, help="the shared 5-shot prefix")
    ap.add_argument("--stem-tokens", type=int, default=32, help="a question's stem: half to 1.5x this")
    ap.add_argument("--hf-batch-sizes", default="8,16")
    ap.add_argument("--dtype", default="auto", help="auto: what the engine picks on this machine")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", type=int, default=32,
                    help="requests also scored by transformers in float32 (bf16 runs): each side's distance to it")
    ap.add_argument("--skip", default="", help="comma list of: hf,second")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m-instruct", Path("~/.cache/batchapi").expanduser())
    engine = LLMEngine(EngineConfig(model_path=model_dir, dtype=args.dtype, max_num_seqs=256,
                                    max_num_batched_tokens=4096, kv_cache_bytes=1 << 30))
    dtype = engine.runner.dtype
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    items = build_items(vocab, args.questions, args.prefix_tokens, args.stem_tokens, args.seed)
    avg = sum(len(it.context) + len(it.choice) for it in items) / len(items)
    print(f"SmolLM2-135M-Instruct, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"{args.questions} questions x {CHOICES} choices = {len(items)} requests ({avg:.0f} tokens avg, "
          f"{args.prefix_tokens}-token {SHOTS}-shot prefix), max_tokens 0, prompt_logprobs 1")

    run_engine(engine, build_items(vocab, 4, args.prefix_tokens, args.stem_tokens, args.seed + 1))  # warm-up
    first = run_engine(engine, items)
    hit = first.cached_tokens / first.prompt_tokens
    print(f"engine, first run (cold prefix cache)   {first}  prefix-cache hits {hit:.1%} "
          f"({first.cached_tokens} of {first.prompt_tokens} prompt tokens)")
    if "second" not in skip:
        second = run_engine(engine, items, reset=False)
        print(f"engine, second run (prefix cache warm; the engine alone, no result cache)  {second}  prefix-cache hits "
              f"{second.cached_tokens / second.prompt_tokens:.1%}")
    if "hf" in skip:
        return

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    best = None
    for batch in [int(b) for b in args.hf_batch_sizes.split(",")]:
        run = run_hf(hf, items, batch, pad)
        run.label = f"batch {batch}"
        print(f"transformers, {run.label:10s}              {run}")
        if best is None or run.cpu < best.cpu:
            best = run
    print(f"engine / transformers ({best.label}): {best.cpu / first.cpu:.2f}x per CPU second, "
          f"{best.wall / first.wall:.2f}x per wall second (target: 3x on the first run)")
    diff, same = agreement(first.scores, best.scores)
    mean = sum(abs(x - y) for x, y in zip(first.scores, best.scores, strict=True)) / len(items)
    tol = TOLERANCE.get(dtype, 1.0)
    print(f"agreement: max |engine - transformers| of a choice's logprob sum {diff:.4f} (mean {mean:.4f}; "
          f"{'within' if diff <= tol else 'OUTSIDE'} {tol} for {str(dtype).removeprefix('torch.')}); "
          f"same pick on {same:.1%} of the questions")
    n = min(args.reference, len(items)) // CHOICES * CHOICES
    if dtype != torch.float32 and n:  # how far each side is from float32, on the first questions
        del hf
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        exact = run_hf(ref, items[:n], 8, pad).scores
        for name, run in (("engine", first), ("transformers", best)):
            d = [abs(x - y) for x, y in zip(run.scores[:n], exact, strict=True)]
            print(f"  {name:12s} vs float32 transformers ({n} requests): max {max(d):.4f}, mean {sum(d) / n:.4f}, "
                  f"same pick on {agreement(run.scores[:n], exact)[1]:.1%}")


if __name__ == "__main__":
    main()

"""Structured outputs on SmolLM2-135M-Instruct: the same classification prompts with and without a
json_schema, output tokens/s of each in one run, and the compile time of each distinct schema.

    .venv/bin/python bench/structured_outputs.py [--prompts 128] [--max-tokens 48] [--threads N] [--repeat 2]

Both runs go through the engine the workers use (continuous batching, greedy); the constrained
one applies the grammar's token mask to every row of every step. Rates are output tokens per CPU
second of this process divided by the thread count (stable on a shared machine) and per wall
second. A constrained answer is short (about 11 tokens here) and a free one runs longer, so
prefill weighs differently per output token; the yardstick is therefore a plain run in which
each prompt generates exactly as many tokens as its constrained answer (ignore_eos): the same
prefill and steps, without the grammar. The runs alternate so drift hits all alike; the best of
--repeat is kept for each. The target is constrained >= 90% of that plain run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from batchapi.engine import EngineConfig, GenerationRequest, LLMEngine, SamplingParams
from batchapi.grammar import GrammarCompiler, GrammarSpec
from batchapi.models.store import resolve_model

LABELS = ["positive", "negative", "neutral", "mixed", "off_topic"]
CLASSIFY = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": LABELS}, "confidence": {"type": "number"}},
    "required": ["label", "confidence"],
    "additionalProperties": False,
}
OTHER_SCHEMAS = {
    "extraction (nested, arrays)": {
        "type": "object",
        "properties": {
            "people": {"type": "array", "maxItems": 5, "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                               "roles": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
                "required": ["name", "age", "roles"], "additionalProperties": False}},
            "place": {"type": "string"}, "date": {"type": "string", "format": "date"},
        },
        "required": ["people", "place", "date"], "additionalProperties": False,
    },
    "$defs/$ref + anyOf": {
        "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string"},
                                                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                              "required": ["city", "zip"], "additionalProperties": False}},
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/address"},
                       "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]}},
        "required": ["home", "work"], "additionalProperties": False,
    },
}
REVIEWS = [
    "The battery lasts two days and the screen is gorgeous.", "It broke after a week. Never again.",
    "Delivery was on time. The box was brown.", "Great sound, but the app crashes all the time.",
    "What is the capital of France?", "Best purchase I made this year, my kids love it.",
    "The soup was cold and the waiter was rude.", "It does what it says, nothing more.",
    "Loved the design, hated the price.", "My cat sat on it and it still works.",
]


def prompts(tokenizer, count: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(count):
        text = (f"Classify the sentiment of this review as one of {', '.join(LABELS)}, with a confidence "
                f"between 0 and 1. Answer in JSON.\n\nReview: {rng.choice(REVIEWS)}")
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


def run(engine: LLMEngine, token_ids: list[list[int]], params: SamplingParams | list[SamplingParams],
        threads: int) -> dict:
    """One request per prompt (``params`` one for all, or one each); results in prompt order."""
    each = params if isinstance(params, list) else [params] * len(token_ids)
    wall, cpu = time.perf_counter(), time.process_time()
    for i, (ids, p) in enumerate(zip(token_ids, each, strict=True)):
        engine.add_request(GenerationRequest(f"r{i}", ids, p))
    results = []
    while engine.has_unfinished():
        results.extend(engine.step())
    wall, cpu = time.perf_counter() - wall, (time.process_time() - cpu) / threads
    results.sort(key=lambda r: int(r.request_id[1:]))
    tokens = sum(r.completion_tokens for r in results)
    texts = [r.outputs[0].text for r in results]
    lengths = [r.completion_tokens for r in results]
    return {"tokens": tokens, "wall": wall, "cpu": cpu, "rate_cpu": tokens / cpu, "rate_wall": tokens / wall,
            "texts": texts, "lengths": lengths, "errors": sum(r.error is not None for r in results)}


def valid_share(texts: list[str]) -> float:
    good = 0
    for text in texts:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        good += isinstance(value, dict) and value.get("label") in LABELS and set(value) == {"label", "confidence"}
    return good / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, Path("~/.cache/batchapi").expanduser())
    engine = LLMEngine(EngineConfig(model_path=model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs))
    token_ids = prompts(engine.tokenizer, args.prompts)

    print(f"model {Path(model_dir).name}, {engine.runner.dtype}, {args.threads} threads, {args.prompts} prompts, "
          f"max_tokens {args.max_tokens}, greedy, max_num_seqs {args.max_num_seqs}")
    print("\ncompile time per distinct schema (cold: a fresh compiler, first submit to result):")
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.model_config.vocab_size)
    for name, spec in [("classification (enum)", GrammarSpec.json_schema(CLASSIFY)),
                       *((n, GrammarSpec.json_schema(s)) for n, s in OTHER_SCHEMAS.items()),
                       ("json_object", GrammarSpec.json_object())]:
        start = time.perf_counter()
        compiler.submit(spec).result()
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.submit(spec).result()
        print(f"  {name:30s} {1000 * cold:8.2f} ms   (cached: {1e6 * (time.perf_counter() - start):.0f} us)")
    compiler.close()

    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                 grammar=GrammarSpec.json_schema(CLASSIFY))
    run(engine, token_ids[:8], plain, args.threads)  # warm-up: kernels, allocator, the grammar
    lengths = run(engine, token_ids, constrained, args.threads)["lengths"]
    # the plain run that differs only by the grammar: each prompt generates as many tokens as its
    # constrained answer (ignore_eos), so prefill and decode steps are the same work
    matched = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    runs = (("plain, free length", plain), ("plain, the constrained lengths", matched), ("json_schema", constrained))
    best: dict[str, dict] = {}
    for _ in range(args.repeat):
        for name, params in runs:
            result = run(engine, token_ids, params, args.threads)
            if name not in best or result["rate_cpu"] > best[name]["rate_cpu"]:
                best[name] = result
    print("\n| run | output tokens | tokens/s (CPU) | tokens/s (wall) | valid classification JSON | errors |")
    print("|---|---|---|---|---|---|")
    for name, r in best.items():
        print(f"| {name} | {r['tokens']} | {r['rate_cpu']:.1f} | {r['rate_wall']:.1f} | "
              f"{100 * valid_share(r['texts']):.0f}% | {r['errors']} |")
    ratio = best["json_schema"]["rate_cpu"] / best["plain, the constrained lengths"]["rate_cpu"]
    free = best["json_schema"]["rate_cpu"] / best["plain, free length"]["rate_cpu"]
    print(f"\nconstrained / plain at the same lengths, output tokens/s (CPU): {ratio:.3f}  (target >= 0.90)")
    print(f"constrained / plain at free length: {free:.3f} (shorter answers carry more prefill per output token)")
    print(f"example constrained output: {best['json_schema']['texts'][0]!r}")
    print(f"example plain output: {best['plain, free length']['texts'][0][:120]!r}")
    engine.close()


if __name__ == "__main__":
    main()

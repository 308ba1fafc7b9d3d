"""How fast batch validation streams through a big input file.

    .venv/bin/python bench/validation_speed.py [--mb 200] [--model smollm2-135m-instruct]

Builds a JSONL file of the given size (at most 50,000 requests, the default line limit), runs
the validator's scan over it (UTF-8, JSON, every rule, the context check, sharding) and, as
the peer in the same run, a bare ``json.loads`` of every line: the floor any validator that
parses the file must pay. ``--exact`` also times the exact token counting pass that runs in
the background once the batch has started.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from batchapi.config import load_settings
from batchapi.models.registry import model_id
from batchapi.models.store import resolve_model
from batchapi.openai.body import CHAT
from batchapi.openai.lines import iter_lines, parse_line
from batchapi.validation.scanner import Limits, Scanner
from batchapi.validation.token_counts import PromptCounter, exact_counts

WORDS = ("the quick brown fox jumps over a lazy dog while engineers measure throughput of batch "
         "inference systems with paged attention and careful validation of every request line").split()


def build(path: Path, megabytes: int, model: str, lines: int = 50_000) -> None:
    rng = random.Random(0)
    per_line = megabytes * 1_000_000 // lines
    with open(path, "w") as out:
        for i in range(lines):
            words = " ".join(rng.choice(WORDS) for _ in range(per_line // 6))
            body = {"model": model, "max_tokens": 64, "messages": [
                {"role": "system", "content": "Classify the text."}, {"role": "user", "content": words}]}
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")


def chunks(path: Path):
    with open(path, "rb") as f:
        while data := f.read(1 << 20):
            yield data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--file", default="/tmp/batchapi-validation-bench.jsonl")
    parser.add_argument("--exact", action="store_true", help="also time the exact token counting pass")
    args = parser.parse_args()
    settings = load_settings(model=args.model)
    mid = model_id(args.model)
    path = Path(args.file)
    if not path.exists() or path.stat().st_size < args.mb * 900_000:
        build(path, args.mb, mid)
    size = path.stat().st_size

    start = time.perf_counter()
    for _, _, _, line in iter_lines(chunks(path)):
        json.loads(line)
    floor = time.perf_counter() - start

    counter = PromptCounter(resolve_model(args.model, settings.model_cache))
    limits = Limits(CHAT, mid, frozenset({mid}), settings.max_file_lines, settings.shard_size)
    start = time.perf_counter()
    result = Scanner(limits, counter).scan(chunks(path))
    took = time.perf_counter() - start
    assert not result.errors, result.errors[:3]

    print(f"file: {size / 1e6:.0f} MB, {result.request_count} requests in {len(result.shards)} shards")
    print(f"validate (batch leaves 'validating'): {took:.2f} s ({size / 1e6 / took:.0f} MB/s)")
    print(f"json.loads floor: {floor:.2f} s; validate / floor = {took / floor:.1f}x")
    if args.exact:
        start = time.perf_counter()
        parsed = [parse_line(line, n, CHAT).body for n, _, _, line in iter_lines(chunks(path))]
        tokens = sum(exact_counts(counter, parsed))
        took = time.perf_counter() - start
        print(f"exact counting pass (background, after the batch started): {took:.1f} s, "
              f"{tokens / 1e6:.1f}M tokens ({tokens / took / 1e6:.2f}M tokens/s)")


if __name__ == "__main__":
    main()

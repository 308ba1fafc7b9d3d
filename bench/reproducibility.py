"""Batch invariance on the real model: does a request give the same tokens alone and in a crowd?

12 probe prompts are run each alone, then as 4 copies each shuffled among 96 other prompts in one
batch, with prefix caching on and off, greedy and seeded (temperature 0.8, top_p 0.95, a seed per
request). Prints how many of the copies gave exactly the tokens of the request run alone, with
batch invariance off and on, in one run:

    python bench/reproducibility.py [--max-tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import chat_prompts  # noqa: E402

from batchapi.engine import EngineConfig, GenerationRequest, LLMEngine, SamplingParams  # noqa: E402
from batchapi.models.store import resolve_model  # noqa: E402

PROBES = ["What is 12 plus 30?", "Name three primary colors.", "Write a haiku about rain.",
          "What is the capital of France?", "Give me a synonym for happy.", "Explain gravity in one sentence.",
          "List two uses of copper.", "Translate 'good morning' into Spanish.", "Is a tomato a fruit?",
          "Write one sentence about the moon.", "What does a bee make?", "Count from 1 to 5."]


def run(engine: LLMEngine, batch: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    engine.block_manager.reset_prefix_cache()
    for request_id, prompt, params in batch:
        engine.add_request(GenerationRequest(request_id, prompt, params))
    out = {}
    while engine.has_unfinished():
        for result in engine.step():
            out[result.request_id] = result.outputs[0].token_ids
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m-instruct", Path("~/.cache/batchapi").expanduser())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probes = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                             add_generation_prompt=True), add_special_tokens=False)
              for p in PROBES]
    others = chat_prompts(tokenizer, 96, seed=1)
    modes = {"greedy": lambda i: SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
             "seeded": lambda i: SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=1000 + i)}
    for invariant in (False, True):
        for prefix in (True, False):
            config = EngineConfig(model_path=model_dir, dtype=args.dtype, max_num_batched_tokens=4096,
                                  kv_cache_bytes=2 << 30, enable_prefix_caching=prefix, batch_invariant=invariant)
            engine = LLMEngine(config)
            for mode, params in modes.items():
                start = time.perf_counter()
                alone = {i: run(engine, [(f"p{i}", probes[i], params(i))])[f"p{i}"] for i in range(len(probes))}
                batch = [(f"p{i}.{c}", probes[i], params(i)) for i in range(len(probes)) for c in range(4)]
                batch += [(f"o{j}", prompt, params(100 + j)) for j, prompt in enumerate(others)]
                random.Random(7).shuffle(batch)
                crowd = run(engine, batch)
                same = sum(crowd[f"p{i}.{c}"] == alone[i] for i in range(len(probes)) for c in range(4))
                print(f"{engine.runner.dtype} invariant={'on ' if invariant else 'off'} prefix caching "
                      f"{'on ' if prefix else 'off'} {mode}: {same}/{4 * len(probes)} copies as alone "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
            engine.close()


if __name__ == "__main__":
    main()

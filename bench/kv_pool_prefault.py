"""The KV pool's first touches: the bare engine on SmolLM2's chat prompts, each `kv_pool_prefault`
mode in a fresh process (a process reuses the memory it freed, so only a new one has a fresh pool).

    .venv/bin/python bench/kv_pool_prefault.py [--prompts 96] [--rounds 2] [--idle 8] [--kv-gib 2]

For each of `off` (pages faulted in by the steps that first write them), `idle` (an idle-class
thread from the end of the first step on), `idle` after --idle seconds of idling with the warmer
let go at once, and `start` (all before the engine is built): seconds to build the engine, then
--rounds runs of the same prompts (greedy, 96 tokens; the prefix cache reset before each, as
engine_throughput.py's runs), each with its tok/s wall and the blocks faulted in ahead by then,
and the KV store's seconds (`rotary_store`, timed around its calls), where a first touch lands.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = [("off", 0.0), ("idle", 0.0), ("idle", None), ("start", 0.0)]  # None: --idle seconds, warmer let go


def child(mode: str, idle: float, prompts: int, rounds: int, kv_gib: float) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_throughput import chat_prompts, run_engine
    from transformers import AutoTokenizer

    from batchapi.engine import EngineConfig, LLMEngine, SamplingParams
    from batchapi.models.store import resolve_model

    model_dir = resolve_model("smollm2-135m-instruct", Path("~/.cache/batchapi").expanduser())
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model_path=model_dir, max_num_seqs=256, max_num_batched_tokens=4096,
                                    kv_cache_bytes=int(kv_gib * 2**30), kv_pool_prefault=mode))
    built = time.perf_counter() - start
    warmer = engine.runner.pool_warmer
    ids = chat_prompts(AutoTokenizer.from_pretrained(model_dir), prompts)
    greedy = SamplingParams(max_tokens=96, temperature=0.0)
    if idle:
        warmer.go()
        time.sleep(idle)
    ops, runs = engine.runner.ops, []
    store = ops.rotary_store
    spent = [0.0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return store(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    object.__setattr__(ops, "rotary_store", timed)
    for _ in range(rounds):
        spent[0] = 0.0
        run = run_engine(engine, ids, greedy)
        runs.append({"tok_s": run.tokens / run.wall, "wall": run.wall, "kv_store": spent[0],
                     "warmed": warmer.warmed if warmer else None})
    object.__setattr__(ops, "rotary_store", store)
    blocks = engine.runner.num_blocks
    engine.close()
    return {"built": built, "runs": runs, "blocks": blocks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle", type=float, default=8.0, help="seconds the third case idles before its runs")
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "IDLE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child(args.child[0], float(args.child[1]), args.prompts, args.rounds, args.kv_gib)
        print(json.dumps(result), flush=True)
        return
    print(f"SmolLM2-135M-Instruct, {args.prompts} chat prompts, max_tokens 96, greedy; a {args.kv_gib:g} GiB "
          "pool; each case a fresh process")
    for mode, idle in CASES:
        idle = args.idle if idle is None else idle
        out = subprocess.run([sys.executable, __file__, "--child", mode, str(idle), "--prompts", str(args.prompts),
                              "--rounds", str(args.rounds), "--kv-gib", str(args.kv_gib)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        result = json.loads(out)
        label = f"{mode}" + (f", {idle:g} s idle first" if idle else "")
        runs = "; ".join(f"{r['tok_s']:.1f} tok/s (KV store {r['kv_store']:.2f} of {r['wall']:.2f} s"
                         + (f", {r['warmed']}/{result['blocks']} blocks ahead)" if r["warmed"] is not None else ")")
                         for r in result["runs"])
        print(f"{label:22s} engine built in {result['built']:.1f} s; {runs}")


if __name__ == "__main__":
    main()

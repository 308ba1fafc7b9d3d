"""The kernel half of bench/gpu_check.py: Triton kernels against their twins, and KV bandwidth.

report is gpu_check's Report (add(check, result, verdict)). The test builders come from
tests/kernels (gpu_check puts the repository root on sys.path).
"""

import gc
import random
import time

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_kernels(report, device: str, dtypes, big: bool) -> None:
    import torch

    from batchapi.kernels import TORCH_OPS, build_rope_cache, get_ops
    from batchapi.kernels.triton import attention as triton_attention
    from tests.kernels.paged import make_case

    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
    ops = get_ops("triton", device)
    rng = random.Random(0)
    for dtype in dtypes:
        worst, cases = 0.0, 0
        max_ctx, num_seqs = (2000, 24) if big else (40, 4)
        for seed in range(6 if big else 2):
            hkv, group = rng.choice([(8, 4), (2, 3), (1, 5), (4, 2), (8, 1)])
            q_lens, ctx_lens = [], []
            for i in range(num_seqs):
                ctx = rng.randint(1, max_ctx)
                kind = i % 3
                q_lens.append(1 if kind == 0 else ctx if kind == 1 else rng.randint(1, ctx))
                ctx_lens.append(ctx)
            case = make_case(q_lens, ctx_lens, hkv * group, hkv, rng.choice([64, 128]), dtype=dtype,
                             seed=seed, device=device)
            worst = max(worst, _attention_err(case, triton_attention, None))
            cases += 1
        long = [8000, 3000] if big else [90, 70]
        for splits in (None, 4):  # auto (split-KV chosen for 2 long decodes on a GPU) and forced
            case = make_case([1, 1], long, 32, 8, 128 if big else 64, dtype=dtype, seed=9, device=device)
            worst = max(worst, _attention_err(case, triton_attention, splits))
            cases += 1
        if big:  # element offsets past 2^31: 140k blocks of 16 x 8 x 128
            case = make_case([1, 1, 7], [300, 17, 40], 32, 8, 128, dtype=dtype, seed=11, device=device,
                             num_blocks=140_000)
            worst = max(worst, _attention_err(case, triton_attention, None))
            cases += 1
        verdict = "ok" if worst <= tol[dtype] * 4 else "FAIL"
        report.add(f"paged_attention vs twin, {_name(dtype)}", f"{cases} cases, max err {worst:.1e} "
                   f"(tol {tol[dtype] * 4:.0e})", verdict)

        n, hidden = (512, 4096) if big else (5, 192)
        x, res = torch.randn(n, hidden, device=device).to(dtype), torch.randn(n, hidden, device=device).to(dtype)
        w = torch.randn(hidden, device=device).to(dtype)
        gate_up = torch.randn(n, 2 * hidden, device=device).to(dtype)
        qkv = torch.randn(n, 48 * 128, device=device).to(dtype)
        q, k = qkv[:, : 32 * 128].view(n, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(n, 8, 128)
        cos_sin = build_rope_cache(128, 8192, 500000.0, LLAMA3_ROPE, device, torch.float32)
        pos = torch.randint(0, 8192, (n,), device=device)
        errs = [
            _rel_err(ops.rms_norm(x, w, 1e-5), TORCH_OPS.rms_norm(x, w, 1e-5)),
            _rel_err(ops.fused_add_rms_norm(x, res, w, 1e-5)[0], TORCH_OPS.fused_add_rms_norm(x, res, w, 1e-5)[0]),
            _rel_err(ops.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up)),
            _rel_err(ops.rotary(q, k, pos, cos_sin)[0], TORCH_OPS.rotary(q, k, pos, cos_sin)[0]),
            _store_err(ops, TORCH_OPS, k, device, dtype),
        ]
        limit = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # ~ one ulp
        report.add(f"norm/rotary/silu/store vs twins, {_name(dtype)}",
                   "max rel errs " + " ".join(f"{e:.1e}" for e in errs), "ok" if max(errs) <= limit else "FAIL")


def attention_bandwidth(report, device: str, sizes=((256, 1024), (4, 16384))) -> None:
    """Decode attention at the 8B shape: KV bytes read per second, Triton vs the twin (SDPA)."""
    import torch

    from batchapi.kernels.torch import attention as twin_attention
    from batchapi.kernels.triton import attention
    from tests.kernels.paged import make_case

    for batch, ctx in sizes:
        case = make_case([1] * batch, [ctx] * batch, 32, 8, 128, dtype=torch.bfloat16, seed=3, device=device)
        kv_bytes = 2 * batch * ctx * 8 * 128 * 2
        rates = []
        for fn in (attention.paged_attention, twin_attention.paged_attention):
            fn(*case.args(), case.scale)
            sync(device)
            start, reps = time.perf_counter(), 20
            for _ in range(reps):
                fn(*case.args(), case.scale)
            sync(device)
            rates.append(kv_bytes * reps / (time.perf_counter() - start) / 1e12)
        report.add(f"decode attention 8B shape, batch {batch} ctx {ctx}",
                   f"Triton {rates[0]:.2f} TB/s of KV, twin {rates[1]:.2f} TB/s (HBM 4.8)", "info")
        del case
        free_memory()


def _attention_err(case, attention, splits) -> float:
    from batchapi.kernels.torch import attention as twin_attention

    out = attention.paged_attention(*case.args(), case.scale, num_splits=splits)
    ref = twin_attention.paged_attention(*case.args(), case.scale)
    return _err(out, ref)


def _store_err(ops, ref_ops, k, device, dtype) -> float:
    import torch

    caches = [torch.zeros(64, 16, k.shape[1], k.shape[2], dtype=dtype, device=device) for _ in range(4)]
    n = k.shape[0]
    slots = torch.randperm(64 * 16, device=device)[:n]
    slots[::7] = -1
    ops.store_kvcache(k, k, caches[0], caches[1], slots)
    ref_ops.store_kvcache(k, k, caches[2], caches[3], slots)
    return _err(caches[0], caches[2])


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _rel_err(a, b) -> float:
    return _err(a, b) / max(1.0, b.float().abs().max().item())


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()

"""CPU micro-benchmarks: decode-attention twin variants (SmolLM2-135M shapes by default).

Prints ms per call for each variant and its ratio to the first (the plain gather + einsum).
Usage: .venv/bin/python bench/kernels_cpu.py [--batch 96] [--ctx 300] [--spread 50] [--dtype bf16] [--only a,b]
        [--no-mallopt]  (by default glibc keeps freed buffers mapped, as the engine sets it on CPU)
        [--layers 30]  (the C kernel alone over 30 layers' caches in turn: keys and values from memory)
   or: .venv/bin/python bench/kernels_cpu.py --op apply_token_bitmask [--rows 64] [--vocab 49152]
        (the grammar's token bitmask applied to logits: its torch twin against the C kernel, fp32
        and bf16, for masks that allow a few tokens, nearly all of them, or a random half)
   or: .venv/bin/python bench/kernels_cpu.py --op linear_bf16w [--row-counts 1,8,16,64,256]
        (float32 linear layers of Qwen3-0.6B's shapes: bf16-stored weights in C, kernels/cpu/csrc/matmul.c,
        against oneDNN's packed float32 weights and F.linear, interleaved, GFLOP/s)
   or: .venv/bin/python bench/kernels_cpu.py --op linear_bf16 [--row-counts 1,8,16,64,256]
        (a SmolLM2-135M decode step's bf16 linear layers, weights from memory: the C kernel for
        AVX512-BF16 and, with AMX, the one on AMX tiles, kernels/cpu/csrc/matmul.c, against oneDNN's
        packed bf16 weights, interleaved)
   or: .venv/bin/python bench/kernels_cpu.py --op lm_head_screen [--row-counts 1,8,64,256]
        (the same lm_head on SmolLM2's own final hidden states of greedy chat steps: the exact argmax
        against the int8 screen, linear_bf16_argmax_screened, which gives the same choices)
   or: .venv/bin/python bench/kernels_cpu.py --op lm_head_argmax [--row-counts 1,8,64,256]
        (a greedy step's lm_head, SmolLM2-135M's 49,152 x 576, its weights from memory: the C
        kernel's logits then the engine's argmax, against the kernel's argmax folded in, each C kernel)

The figures, per CPU kind, are in docs/BENCHMARKS.md ("CPU kernels"). v_native is the C kernel the
engine uses on CPU (kernels/cpu/csrc/paged_decode.c), on AMX tiles where the CPU has them for bf16;
v_native_vector the same kernel kept on the vector units; v_library the torch path it falls back to.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from batchapi.kernels.cpu import memory


def make_inputs(batch, ctx, hq, hkv, d, block_size, dtype, seed=0, spread=50, blocks="random"):
    """blocks "random": each sequence's blocks anywhere in the pool; "runs": each sequence's blocks one
    run of it, as a fresh engine hands a prompt's blocks out (its free list in order)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(ctx - spread, ctx + spread, (batch,), generator=g).int()
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    num_blocks = batch * max_blocks + 7
    ids = torch.randperm(num_blocks, generator=g) if blocks == "random" else torch.arange(num_blocks)
    perm = ids[: batch * max_blocks].view(batch, max_blocks).int()
    nblk = (lens + block_size - 1) // block_size
    tables = torch.where(torch.arange(max_blocks)[None] < nblk[:, None], perm, -1).int()
    # the pool in huge pages where the OS gives them, as the engine's (kernels/cpu/memory.py)
    k_cache = memory.zeroed((num_blocks, block_size, hkv, d), dtype)
    k_cache.copy_(torch.randn(num_blocks, block_size, hkv, d, generator=g))
    v_cache = memory.zeroed((num_blocks, block_size, hkv, d), dtype)
    v_cache.copy_(torch.randn(num_blocks, block_size, hkv, d, generator=g))
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, lens


def _gather(cache, tables):
    nb, bs, hkv, d = cache.shape
    b, mb = tables.shape
    return cache[tables.clamp(min=0)].view(b, mb * bs, hkv, d)  # [B, L, Hkv, D]


def _mask(tables, lens, block_size):
    pos = torch.arange(tables.shape[1] * block_size)
    return pos[None, :] < lens[:, None]  # [B, L]


def v_einsum(q, kc, vc, tables, lens, scale):
    b, hq, d = q.shape
    hkv = kc.shape[2]
    k, v = _gather(kc, tables), _gather(vc, tables)
    qg = q.view(b, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k).float() * scale
    s.masked_fill_(~_mask(tables, lens, kc.shape[1])[:, None, None, :], float("-inf"))
    p = s.softmax(-1).to(q.dtype)
    return torch.einsum("bhgl,blhd->bhgd", p, v).reshape(b, hq, d)


def v_sdpa(q, kc, vc, tables, lens, scale):
    b, hq, d = q.shape
    hkv = kc.shape[2]
    k = _gather(kc, tables).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather(vc, tables).transpose(1, 2)
    qg = q.view(b, hkv, hq // hkv, d)
    m = _mask(tables, lens, kc.shape[1])[:, None, None, :]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale).reshape(b, hq, d)


def v_sdpa_contig(q, kc, vc, tables, lens, scale):
    b, hq, d = q.shape
    hkv = kc.shape[2]
    k = _gather(kc, tables).transpose(1, 2).contiguous()
    v = _gather(vc, tables).transpose(1, 2).contiguous()
    qg = q.view(b, hkv, hq // hkv, d)
    m = _mask(tables, lens, kc.shape[1])[:, None, None, :]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale).reshape(b, hq, d)


def v_sdpa_trim(q, kc, vc, tables, lens, scale):
    """Gather only up to the longest context, via slot indices (not whole blocks)."""
    b, hq, d = q.shape
    nb, bs, hkv, _ = kc.shape
    max_len = int(lens.max())
    pos = torch.arange(max_len)
    slots = tables.clamp(min=0).long()[:, pos // bs] * bs + pos % bs  # [B, Lmax]
    k = kc.view(-1, hkv, d)[slots].transpose(1, 2)  # [B, Hkv, Lmax, D]
    v = vc.view(-1, hkv, d)[slots].transpose(1, 2)
    qg = q.view(b, hkv, hq // hkv, d)
    m = (pos[None] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale).reshape(b, hq, d)


def v_float(q, kc, vc, tables, lens, scale):
    b, hq, d = q.shape
    hkv = kc.shape[2]
    k, v = _gather(kc, tables).float(), _gather(vc, tables).float()
    qg = q.float().view(b, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    s.masked_fill_(~_mask(tables, lens, kc.shape[1])[:, None, None, :], float("-inf"))
    return torch.einsum("bhgl,blhd->bhgd", s.softmax(-1), v).reshape(b, hq, d).to(q.dtype)


def v_loop(q, kc, vc, tables, lens, scale):
    """Baseline: one SDPA per sequence."""
    b, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = torch.empty_like(q)
    for i, n in enumerate(lens.tolist()):
        nblk = (n + bs - 1) // bs
        blocks = tables[i, :nblk].long()
        k = kc[blocks].view(-1, hkv, d)[:n].transpose(0, 1)  # [Hkv, n, D]
        v = vc[blocks].view(-1, hkv, d)[:n].transpose(0, 1)
        qg = q[i].view(hkv, hq // hkv, d)
        out[i] = F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(hq, d)
    return out


def _gather_sel(cache, tables, n):
    b, mb = tables.shape
    bs, hkv, d = cache.shape[1:]
    kv = cache.index_select(0, tables.clamp(min=0).reshape(-1).long()).view(b, mb * bs, hkv, d)
    return kv[:, :n].transpose(1, 2)  # [B, Hkv, n, D]


def _bias(lens, n, dtype):
    pos = torch.arange(n)
    bias = torch.zeros(len(lens), 1, 1, n, dtype=dtype)
    return bias.masked_fill_((pos[None] >= lens[:, None])[:, None, None, :], float("-inf"))


def v_gqa_bool(q, kc, vc, tables, lens, scale):
    b, hq, d = q.shape
    n = int(lens.max())
    tables = tables[:, : (n + kc.shape[1] - 1) // kc.shape[1]]
    k, v = _gather_sel(kc, tables, n), _gather_sel(vc, tables, n)
    m = (torch.arange(n)[None] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=m, scale=scale, enable_gqa=True)
    return out.view(b, hq, d)


def v_gqa_bool_2d(q, kc, vc, tables, lens, scale):
    """v_gqa_bool gathering through a 2-D view of the cache (whole-row copies)."""
    b, hq, d = q.shape
    n = int(lens.max())
    nb, bs, hkv, _ = kc.shape
    tables = tables[:, : (n + bs - 1) // bs]
    flat = tables.clamp(min=0).reshape(-1).long()
    k = kc.view(nb, -1).index_select(0, flat).view(b, -1, hkv, d)[:, :n].transpose(1, 2)
    v = vc.view(nb, -1).index_select(0, flat).view(b, -1, hkv, d)[:, :n].transpose(1, 2)
    m = (torch.arange(n)[None] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=m, scale=scale, enable_gqa=True)
    return out.view(b, hq, d)


def v_gqa_bool_clean(q, kc, vc, tables, lens, scale):
    """v_gqa_bool, with masked slots zeroed so that NaN garbage in unwritten cache slots cannot leak."""
    b, hq, d = q.shape
    n = int(lens.max())
    tables = tables[:, : (n + kc.shape[1] - 1) // kc.shape[1]]
    k, v = _gather_sel(kc, tables, n), _gather_sel(vc, tables, n)
    m = (torch.arange(n)[None] < lens[:, None])[:, None, :, None]  # [B, 1, L, 1]
    k, v = k.masked_fill(~m, 0), v.masked_fill(~m, 0)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=m.transpose(2, 3), scale=scale,
                                         enable_gqa=True)
    return out.view(b, hq, d)


def v_gqa_bool_inplace(q, kc, vc, tables, lens, scale):
    """Zero the masked slots in the gathered buffer before transposing."""
    b, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    n = int(lens.max())
    tables = tables[:, : (n + bs - 1) // bs]
    flat = tables.clamp(min=0).reshape(-1).long()
    m = torch.arange(tables.shape[1] * bs)[None] < lens[:, None]  # [B, L]
    k = kc.index_select(0, flat).view(b, -1, hkv, d)
    v = vc.index_select(0, flat).view(b, -1, hkv, d)
    k[~m] = 0
    v[~m] = 0
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=m[:, None, None, :], scale=scale, enable_gqa=True)
    return out.view(b, hq, d)


def v_group_bias(q, kc, vc, tables, lens, scale):
    b, hq, d = q.shape
    hkv = kc.shape[2]
    n = int(lens.max())
    tables = tables[:, : (n + kc.shape[1] - 1) // kc.shape[1]]
    k, v = _gather_sel(kc, tables, n), _gather_sel(vc, tables, n)
    qg = q.view(b, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=_bias(lens, n, q.dtype), scale=scale)
    return out.reshape(b, hq, d)


def v_fp32_gqa_bias(q, kc, vc, tables, lens, scale):
    b, hq, d = q.shape
    n = int(lens.max())
    tables = tables[:, : (n + kc.shape[1] - 1) // kc.shape[1]]
    k, v = _gather_sel(kc, tables, n).float(), _gather_sel(vc, tables, n).float()
    out = F.scaled_dot_product_attention(q[:, :, None].float(), k, v, attn_mask=_bias(lens, n, torch.float32),
                                         scale=scale, enable_gqa=True)
    return out.view(b, hq, d).to(q.dtype)


def _chunked(q, kc, vc, tables, lens, scale, chunk):
    """v_gqa_bool over chunks of sequences, so that each chunk's gathered K/V stays in cache for SDPA."""
    return torch.cat([v_gqa_bool(q[i : i + chunk], kc, vc, tables[i : i + chunk], lens[i : i + chunk], scale)
                      for i in range(0, q.shape[0], chunk)])


def v_chunk8(q, kc, vc, tables, lens, scale):
    return _chunked(q, kc, vc, tables, lens, scale, 8)


def v_chunk24(q, kc, vc, tables, lens, scale):
    return _chunked(q, kc, vc, tables, lens, scale, 24)


def v_library(q, kc, vc, tables, lens, scale):
    from batchapi.kernels.torch.attention import paged_attention

    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(q, kc, vc, tables, cu, lens, scale)


def v_native(q, kc, vc, tables, lens, scale):
    # the engine's CPU default: decode attention in C reading the blocks in place (kernels/cpu/attention.py)
    from batchapi.kernels.cpu.attention import paged_attention

    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(q, kc, vc, tables, cu, lens, scale)


def v_native_vector(q, kc, vc, tables, lens, scale):
    # the same C kernel kept on the vector units where its bf16 decode runs on AMX tiles
    from batchapi.kernels.cpu import build

    lib = build.load()
    lib.paged_decode_set_amx(0)
    try:
        return v_native(q, kc, vc, tables, lens, scale)
    finally:
        lib.paged_decode_set_amx(1)


VARIANTS = [
    v_einsum, v_sdpa, v_sdpa_contig, v_sdpa_trim, v_float, v_loop, v_gqa_bool, v_gqa_bool_2d, v_gqa_bool_clean,
    v_gqa_bool_inplace, v_group_bias, v_fp32_gqa_bias, v_chunk8, v_chunk24, v_library, v_native, v_native_vector,
]


def bench_native_from_memory(a, dtype):
    """The engine's C kernel (v_native) over ``a.layers`` layers' caches in turn, each its own blocks
    (``a.blocks``: anywhere in the pool, or a run of it a sequence), as a decode step calls it: each call's keys and values come from memory, not from the
    cache the call before left them in (the single-layer timing above reads them from L2 or L3). Best
    and median ms a call, and the KV bytes a call reads per second."""
    layers = [make_inputs(a.batch, a.ctx, a.hq, a.hkv, a.dim, a.block_size, dtype, seed=i, spread=a.spread,
                          blocks=a.blocks)
              for i in range(a.layers)]
    scale = a.dim**-0.5

    from batchapi.kernels.cpu import build

    def steps(variant):
        def step():
            for q, kc, vc, tables, lens in layers:
                variant(q, kc, vc, tables, lens, scale)
        step.__name__ = variant.__name__
        return step

    # where bf16 decode runs on AMX tiles, the vector units' path beside it
    tiles = a.dtype == "bf16" and a.dim % 32 == 0 and build.load().paged_decode_amx()
    fns = [steps(v) for v in ([v_native, v_native_vector] if tiles else [v_native])]
    timings = bench_interleaved(fns, (), a.reps)
    kv = sum(int(lens.sum()) for *_, lens in layers) / a.layers * a.hkv * a.dim * 2 * (2 if a.dtype == "bf16" else 4)
    print(f"decode B={a.batch} ctx {a.ctx}+-{a.spread} Hq={a.hq} Hkv={a.hkv} D={a.dim} {a.dtype} "
          f"block size {a.block_size}, threads={torch.get_num_threads()}, {a.layers} layers' caches in turn")
    for fn in fns:
        best, median = (ms / a.layers for ms in timings[fn])
        print(f"{fn.__name__} from memory: best {best:.3f} ms  median {median:.3f} ms a call, "
              f"{kv / 1e6:.1f} MB of keys and values a call, {kv / best / 1e6:.1f} GB/s")


def bench_interleaved(fns, args, reps):
    """Best-of-reps ms per call, the variants taking turns so that load from other processes on a
    shared machine hits them alike; the minimum is the least disturbed run."""
    for fn in fns:
        fn(*args)
    times = {fn: [] for fn in fns}
    for _ in range(reps):
        for fn in fns:
            t0 = time.perf_counter()
            fn(*args)
            times[fn].append(time.perf_counter() - t0)
    return {fn: (min(t) * 1e3, sorted(t)[len(t) // 2] * 1e3) for fn, t in times.items()}


def bench_bitmask(a):
    """Best and median ms of ops.apply_token_bitmask, twin against C, on every row of [rows, vocab] logits."""
    from batchapi.kernels.cpu import elementwise
    from batchapi.kernels.torch import bitmask as twin

    g, words, rows = torch.Generator().manual_seed(0), (a.vocab + 31) // 32, list(range(a.rows))
    few = torch.zeros(a.rows, words, dtype=torch.int32)
    few[:, 5] = 0x1011  # a JSON punctuation step: a handful of tokens allowed
    most = torch.full((a.rows, words), -1, dtype=torch.int32)
    most[:, 7] = ~0x4  # inside a string: all but a few tokens allowed
    half = torch.randint(-2**31, 2**31, (a.rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    print(f"apply_token_bitmask {a.rows} rows x {a.vocab} vocab, threads={torch.get_num_threads()}")
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(a.rows, a.vocab, generator=g).to(dtype)
        for kind, mask in (("few", few), ("most", most), ("random", half)):
            fns = [twin.apply_token_bitmask, elementwise.apply_token_bitmask]
            (tb, tm), (cb, cm) = bench_interleaved(fns, (logits, mask, rows), a.reps).values()
            print(f"{str(dtype)[6:]:9s} {kind:7s} twin best {tb:6.3f} median {tm:6.3f} ms   C best {cb:6.3f} "
                  f"median {cm:6.3f} ms   x{tb / cb:5.1f}")


LINEAR_SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
                 "down_proj": (1024, 3072), "lm_head": (151936, 1024)}  # Qwen3-0.6B: (out, in)


def bench_linear(a):
    """Best ms per call of a float32 linear layer: bf16-stored weights (C) against oneDNN's packed
    float32 and F.linear (MKL), at each row count, the three taking turns."""
    from batchapi.engine.model import onednn
    from batchapi.kernels.cpu import matmul

    print(f"float32 linear layers, Qwen3-0.6B's shapes, threads={torch.get_num_threads()}; GFLOP/s and the C "
          "kernel's speed-up over oneDNN")
    g = torch.Generator().manual_seed(0)
    for name, (out_features, in_features) in LINEAR_SHAPES.items():
        weight = torch.randn(out_features, in_features, generator=g).bfloat16().float()
        packed, onednn_packed = matmul.pack(weight), onednn.pack(weight, 64)
        for rows in map(int, a.row_counts.split(",")):
            x = torch.randn(rows, in_features, generator=g)
            fns = [lambda x, w=packed, n=out_features: matmul.linear(x, w, n, None),
                   lambda x, w=onednn_packed: onednn.linear(x, w, None), lambda x, w=weight: F.linear(x, w)]
            reps = max(3, min(a.reps, int(3e9 / (rows * out_features * in_features))))
            (c, _), (o, _), (m, _) = bench_interleaved(fns, (x,), reps).values()
            flops = 2 * rows * out_features * in_features / 1e6  # per ms: GFLOP/s
            print(f"{name:13s} {out_features:>6d}x{in_features:<5d} {rows:4d} rows: C {c:8.2f} ms {flops / c:5.0f}   "
                  f"oneDNN {o:8.2f} ms {flops / o:5.0f}   F.linear {m:8.2f} ms {flops / m:5.0f}   x{o / c:4.2f}")


SMOLLM2_LAYER = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
                 "down_proj": (576, 1536)}  # (out, in) of one of its 30 layers; lm_head 49152 x 576


def bench_linear_bf16(a):
    """Best ms of a decode step's linear layers, SmolLM2-135M's 30 layers and lm_head in turn (each
    weight read from memory, as in a step, not from cache), bf16: the C kernel for AVX512-BF16 on each
    of its instructions (VDPBF16PS, "C dpbf16"; FMAs in its order, "C fma": the same bits) and, where
    the CPU has AMX, the C kernel on AMX tiles, against oneDNN's packed bf16 layers, at each row count,
    taking turns. The C kernels' weights lie in huge pages, as the engine's (kernels/cpu/memory.py); the
    fastest kernel runs once more on the same weights on the small pages torch gives ("4K pages")."""
    from batchapi.engine.model import onednn
    from batchapi.kernels.cpu import matmul, memory

    if not matmul.native_bf16():
        raise SystemExit("linear_bf16: this CPU (or this build) has no AVX512-BF16")
    g = torch.Generator().manual_seed(0)
    shapes = [*SMOLLM2_LAYER.values()] * 30 + [(49152, 576)]
    weights = [torch.randn(shape, generator=g).bfloat16() for shape in shapes]
    arena = memory.Arena()  # the weights in huge pages, as the engine packs them (engine/model/linears.py)
    small_pages = [(matmul.pack_pairs(w), *w.shape) for w in weights]
    c_layers = [(arena.copy(packed), n, k) for packed, n, k in small_pages]
    onednn_layers = [onednn.pack(w, 256) for w in weights]
    params = sum(w.numel() for w in weights)
    chosen = matmul.bf16_instructions()
    kernels = {f"C {name}": (matmul.linear_bf16, name, c_layers) for name in matmul.INSTRUCTIONS}
    if matmul.native_amx():
        kernels["AMX"] = (matmul.linear_amx, None, c_layers)
    fastest = "AMX" if matmul.native_amx() else f"C {chosen}"
    kernels[f"{fastest} 4K pages"] = (kernels[fastest][0], kernels[fastest][1], small_pages)
    print(f"the process's choice at load: {chosen}")
    print(f"bf16 linear layers of a SmolLM2-135M decode step ({params / 1e6:.1f}M weights, {len(shapes)} calls), "
          f"threads={torch.get_num_threads()}; GFLOP/s and each C kernel's speed-up over oneDNN")
    for rows in map(int, a.row_counts.split(",")):
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in shapes}

        def c_step(xs, kernel, instructions, layers):
            if instructions:
                matmul.bf16_instructions(instructions)
            for packed, n, k in layers:
                kernel(xs[k], packed, n, k, None)

        def onednn_step(xs):
            for (_, k), packed in zip(shapes, onednn_layers, strict=True):
                onednn.linear(xs[k], packed, None)

        steps = [lambda xs, kernel=kernel, on=on, layers=layers: c_step(xs, kernel, on, layers)
                 for kernel, on, layers in kernels.values()]
        reps = max(3, min(a.reps, int(2e10 / (rows * params))))
        *mine, (o, _) = bench_interleaved([*steps, onednn_step], (xs,), reps).values()
        flops = 2 * rows * params / 1e6  # per ms: GFLOP/s
        print(f"{rows:4d} rows: " + "   ".join(f"{name} {c:7.2f} ms {flops / c:5.0f} x{o / c:4.2f}"
                                             for name, (c, _) in zip(kernels, mine, strict=True))
              + f"   oneDNN {o:7.2f} ms {flops / o:5.0f}")
    matmul.bf16_instructions(chosen)


def bench_lm_head_argmax(a):
    """Best ms of a greedy step's lm_head and argmax: the logits written then the engine's argmax
    (kernels/cpu/elementwise.py) against the kernel's argmax folded into its epilogue, for each C
    kernel here; a 512 MB sweep before each call, so that the weights come from memory as in a step.
    Checks the two give the same tokens."""
    from batchapi.kernels.cpu import elementwise, matmul

    if not matmul.native_bf16():
        raise SystemExit("lm_head_argmax: this CPU (or this build) has no AVX512-BF16")
    g = torch.Generator().manual_seed(0)
    out_features, in_features = 49152, 576
    packed = matmul.pack_pairs(torch.randn(out_features, in_features, generator=g).bfloat16())
    kernels = {"C": (matmul.linear_bf16, matmul.linear_bf16_argmax)}
    if matmul.native_amx():
        kernels["AMX"] = (matmul.linear_amx, matmul.linear_amx_argmax)
    sweep = torch.ones(128 << 20)  # 512 MB: past any cache here
    print(f"lm_head {out_features}x{in_features} and greedy argmax, threads={torch.get_num_threads()}; best ms "
          "of logits-then-argmax, of the argmax in the kernel, and the speed-up")
    for rows in map(int, a.row_counts.split(",")):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        for name, (linear, argmax) in kernels.items():
            def written(x, linear=linear):
                sweep.add_(1.0)
                return elementwise.argmax(linear(x, packed, out_features, in_features, None))

            def folded(x, argmax=argmax):
                sweep.add_(1.0)
                return argmax(x, packed, out_features, in_features, None)

            assert torch.equal(written(x), folded(x)), (name, rows)
            timings = bench_interleaved([written, folded, lambda x: sweep.add_(1.0)], (x,), a.reps)
            (w, _), (f, _), (s, _) = timings.values()
            print(f"{rows:4d} rows {name:3s}: logits + argmax {w - s:7.2f} ms   folded {f - s:7.2f} ms   "
                  f"x{(w - s) / (f - s):4.2f}   (sweep {s:.2f} ms taken off)")


def bench_lm_head_screen(a):
    """Best ms of SmolLM2-135M's greedy lm_head on its own final hidden states (recorded from greedy
    chat steps of the engine): the exact argmax in the kernel against the int8 screen (the same
    choices, checked), and how many of a row's 1,024 groups of columns the screen ran exactly."""
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from batchapi.engine import EngineConfig, GenerationRequest, LLMEngine, SamplingParams
    from batchapi.kernels.cpu import matmul
    from batchapi.models.store import resolve_model

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_throughput import chat_prompts

    if not matmul.screen_native():
        raise SystemExit("lm_head_screen: this CPU (or this build) has no AVX512-BF16 and AVX512-VNNI")
    model_dir = resolve_model("smollm2-135m-instruct", Path("~/.cache/batchapi").expanduser())
    engine = LLMEngine(EngineConfig(model_path=model_dir, dtype="bfloat16", max_num_seqs=64, kv_cache_bytes=256 << 20))
    head = engine.runner.model.lm_head
    rows, argmax = [], head.argmax
    head.argmax = lambda x: rows.append(x.clone()) or argmax(x)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), 64)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(str(i), prompt, SamplingParams(max_tokens=32, temperature=0.0)))
    while engine.has_unfinished():
        engine.step()
    hidden = torch.cat(rows)
    packed, screen, n, k = head.packed_weight, head.screen, head.out_features, head.in_features
    if screen is None:
        screen = matmul.pack_screen(matmul.unpack_pairs(packed, n, k))
    groups = -(-n // 48)
    sweep = torch.ones(128 << 20)  # 512 MB: past any cache here
    print(f"SmolLM2-135M lm_head {n}x{k} on {len(hidden)} recorded final hidden states, threads="
          f"{torch.get_num_threads()}; best ms of the exact argmax in the kernel and of the int8 screen")
    g = torch.Generator().manual_seed(0)
    for count in map(int, a.row_counts.split(",")):
        x = hidden[torch.randperm(len(hidden), generator=g)[:count]].contiguous()
        exact_rows = []

        def exact(x):
            sweep.add_(1.0)
            return matmul.linear_bf16_argmax(x, packed, n, k, None)

        def screened(x, ran_exactly=exact_rows):
            sweep.add_(1.0)
            chosen, ran = matmul.linear_bf16_argmax_screened(x, packed, screen, n, k, None)
            ran_exactly.append(ran)
            return chosen

        assert torch.equal(exact(x), screened(x)), count
        timings = bench_interleaved([exact, screened, lambda x: sweep.add_(1.0)], (x,), a.reps)
        (e, _), (f, _), (s, _) = timings.values()
        print(f"{count:4d} rows: exact {e - s:7.2f} ms   screened {f - s:7.2f} ms   x{(e - s) / (f - s):4.2f}   "
              f"({exact_rows[0] / count:.1f} of {groups} groups a row exactly; sweep {s:.2f} ms taken off)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="paged_attention", choices=["paged_attention", "apply_token_bitmask",
                                                                "linear_bf16w", "linear_bf16", "lm_head_argmax",
                                                                "lm_head_screen"])
    ap.add_argument("--row-counts", default="1,8,16,64,256", help="linear_bf16w, linear_bf16, lm_head_*: rows")
    ap.add_argument("--rows", type=int, default=64, help="apply_token_bitmask: constrained rows")
    ap.add_argument("--vocab", type=int, default=49152, help="apply_token_bitmask: vocabulary size")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--spread", type=int, default=50, help="contexts uniform in ctx +- spread")
    ap.add_argument("--hq", type=int, default=9)
    ap.add_argument("--hkv", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="paged_attention with --layers: tokens a KV block")
    ap.add_argument("--blocks", default="random", choices=["random", "runs"],
                    help="paged_attention with --layers: each sequence's blocks anywhere in the pool, or one run of it")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="")
    ap.add_argument("--layers", type=int, default=1,
                    help="paged_attention: >1 times the C kernel alone over this many layers' caches in turn, "
                         "so that each call's keys and values come from memory, as in a step")
    ap.add_argument("--no-mallopt", action="store_true", help="leave glibc returning big buffers to the OS")
    a = ap.parse_args()
    if not a.no_mallopt:  # as the engine does on CPU: no page faults on every step's buffers
        from batchapi.engine.platform import keep_freed_memory

        keep_freed_memory()
    if a.op == "apply_token_bitmask":
        return bench_bitmask(a)
    if a.op == "linear_bf16w":
        return bench_linear(a)
    if a.op == "linear_bf16":
        return bench_linear_bf16(a)
    if a.op == "lm_head_argmax":
        return bench_lm_head_argmax(a)
    if a.op == "lm_head_screen":
        return bench_lm_head_screen(a)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.layers > 1:
        return bench_native_from_memory(a, dtype)
    q, kc, vc, tables, lens = make_inputs(a.batch, a.ctx, a.hq, a.hkv, a.dim, 16, dtype, spread=a.spread)
    args = (q, kc, vc, tables, lens, a.dim**-0.5)
    ref = v_float(*args).float()
    print(f"decode B={a.batch} ctx {a.ctx}+-{a.spread} Hq={a.hq} Hkv={a.hkv} D={a.dim} {a.dtype} threads={torch.get_num_threads()}")
    fns, errs = [], {}
    for fn in VARIANTS:
        if a.only and fn.__name__ not in a.only.split(","):
            continue
        try:
            errs[fn] = (fn(*args).float() - ref).abs().max().item()
            fns.append(fn)
        except Exception as e:  # a variant may fail on this torch build
            print(f"{fn.__name__:20s} failed: {type(e).__name__}: {e}")
    timings = bench_interleaved(fns, args, a.reps)
    base = timings[fns[0]][0]
    for fn in fns:
        best, median = timings[fn]
        print(f"{fn.__name__:20s} best {best:7.2f} ms  median {median:7.2f} ms  x{base / best:5.2f} vs "
              f"{fns[0].__name__}  max_err {errs[fn]:.1e}")


if __name__ == "__main__":
    main()

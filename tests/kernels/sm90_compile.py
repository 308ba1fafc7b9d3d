"""Compile every Triton kernel, in the configurations the launchers pick, for an H100/H200 (sm_90).

Needs no GPU: Triton's bundled ptxas builds the cubin. Catches what the interpreter cannot: type
errors of compiled Triton, tl.dot shape limits, register spills (reported). Run in a process where
TRITON_INTERPRET is unset: `python -m tests.kernels.sm90_compile [--quiet]`.
"""

import importlib
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


def compile_for_sm90(kernel, types: dict[str, str], constexprs: dict, report: bool = True, **options) -> str:
    """Compile; return ptxas' register/spill line ('' unless report, or where ptxas is not at hand)."""
    assert isinstance(kernel, JITFunction), "run with TRITON_INTERPRET unset"
    signature = {n: "constexpr" if n in constexprs else types.get(n, types["*"]) for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options=options)
    if not report or not os.path.exists(PTXAS):
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        run = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    return " ".join(line.split(": ")[-1].strip() for line in run.stderr.splitlines() if "spill" in line or "regist" in line)


def attention_cases():
    attention = importlib.import_module("batchapi.kernels.triton.attention")
    for dtype in ("bf16", "fp16"):
        # the last three: Gemma 2 (soft-capped) 2B/9B and 27B, Gemma 3 1B; the window is a runtime argument
        for group, head_dim, softcap in ((4, 128, False), (4, 64, False), (3, 64, False), (5, 128, False),
                                         (7, 64, False), (2, 256, True), (2, 128, True), (4, 256, False)):
            for max_q, splits in ((1, 1), (1, 16), (512, 1)):
                if dtype == "fp16" and (group, head_dim, softcap) != (4, 128, False):
                    continue
                tiling = attention.launch_tiling(group, head_dim, max_q)
                ptr = f"*{dtype}"
                types = {"out_ptr": "*fp32" if splits > 1 else ptr, "q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr,
                         "max_ptr": "*fp32", "sum_ptr": "*fp32", "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                         "context_lens_ptr": "*i32", "scale": "fp32", "softcap": "fp32", "*": "i32"}
                options = {k: tiling.pop(k) for k in ("num_warps", "num_stages", "maxnreg")}
                constexprs = dict(HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=16, NUM_SPLITS=splits,
                                  USE_SOFTCAP=softcap, DOT_PRECISION="tf32", **tiling)
                name = f"paged_attention {dtype} G={group} D={head_dim} max_q={max_q} splits={splits}"
                yield name + " softcap" * softcap, \
                    attention._paged_attention_kernel, types, constexprs, options
    yield "merge_splits", attention._merge_splits_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32", "max_ptr": "*fp32",
                                                          "sum_ptr": "*fp32", "*": "i32"}, dict(HEAD_DIM=128, NUM_SPLITS=16), {}


def _elementwise_cases():
    kvcache = importlib.import_module("batchapi.kernels.triton.kvcache")
    norm = importlib.import_module("batchapi.kernels.triton.norm")
    rotary = importlib.import_module("batchapi.kernels.triton.rotary")
    activation = importlib.import_module("batchapi.kernels.triton.activation")
    bitmask = importlib.import_module("batchapi.kernels.triton.bitmask")
    bf = "*bf16"
    yield "store_kvcache", kvcache._store_kvcache_kernel, {"slot_mapping_ptr": "*i64", "*": "i32", **dict.fromkeys(
        ["key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"], bf)}, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16,
                                                                           HEADS_P2=8), {}
    for residual in (False, True):
        yield f"rms_norm residual={residual}", norm._rms_norm_kernel, {"eps": "fp32", "*": "i32", **dict.fromkeys(
            ["out_ptr", "sum_ptr", "x_ptr", "residual_ptr", "weight_ptr"], bf)}, dict(HAS_RESIDUAL=residual,
                                                                                      BLOCK_H=4096), {"num_warps": 8}
    yield "rotary", rotary._rotary_kernel, {"positions_ptr": "*i64", "cos_sin_ptr": "*bf16", "*": "i32", **dict.fromkeys(
        ["q_out_ptr", "k_out_ptr", "q_ptr", "k_ptr"], bf)}, dict(HALF=64, QH_P2=32, KH_P2=8), {}
    for act in ("silu", "gelu_tanh"):
        yield f"{act}_and_mul", activation._act_and_mul_kernel, {"out_ptr": bf, "x_ptr": bf, "*": "i32"}, \
            dict(BLOCK=activation.BLOCK, GELU=act == "gelu_tanh"), {}
    for logits in ("*bf16", "*fp32"):
        yield f"apply_token_bitmask {logits[1:]}", bitmask._apply_token_bitmask_kernel, {
            "logits_ptr": logits, "bitmask_ptr": "*i32", "rows_ptr": "*i64", "*": "i32"}, dict(BLOCK=bitmask.BLOCK), {}


def _matmul_cases():
    matmul = importlib.import_module("batchapi.kernels.triton.matmul")
    for dtype in ("bf16", "fp16", "fp32"):
        for bias in (False, True):
            ptr = f"*{dtype}"
            yield f"matmul {dtype} bias={bias}", matmul._matmul_kernel, {
                "y_ptr": ptr, "x_ptr": ptr, "w_ptr": ptr, "bias_ptr": ptr, "*": "i32"}, dict(
                HAS_BIAS=bias, NUM_PROGRAMS=132, BLOCK_M=matmul.BLOCK_M, BLOCK_N=matmul.BLOCK_N,
                BLOCK_K=matmul.BLOCK_K), {"num_warps": matmul.NUM_WARPS, "num_stages": matmul.NUM_STAGES}


def main() -> int:
    report = "--quiet" not in sys.argv  # --quiet: compile only, no ptxas register report
    failures = 0
    for name, kernel, types, constexprs, options in [*attention_cases(), *_elementwise_cases(), *_matmul_cases()]:
        try:
            print(f"{name}: ok {compile_for_sm90(kernel, types, constexprs, report, **options)}", flush=True)
        except Exception as exc:  # report every failing configuration, not just the first
            failures += 1
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every Triton kernel compiles for sm_90 (H100/H200) in the launchers' configurations, without a GPU.

The interpreter runs kernels as numpy and so cannot catch errors of compiled Triton (types of
loop-carried values, tl.dot shapes); this does. `python -m tests.kernels.sm90_compile` prints
ptxas' register and spill counts as well. The fused MoE kernel's configurations are listed here
(``moe_cases``) and compiled with the same helper; its and the attention kernels' ptxas reports are
checked for spills.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.kernels.sm90_compile", "--quiet"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def moe_cases():
    """The grouped GEMM of kernels.triton.moe, gate/up and down, in the launcher's tiling."""
    moe = importlib.import_module("batchapi.kernels.triton.moe")
    configs = [(dtype, gated, "fp32") for dtype in ("bf16", "fp16", "fp32") for gated in (True, False)]
    configs.append(("bf16", False, "bf16"))  # routing weights in the activations' dtype (Qwen3-MoE)
    for dtype, gated, weights in configs:
        ptr = f"*{dtype}"
        types = {"out_ptr": ptr, "a_ptr": ptr, "w_ptr": ptr, "weights_ptr": f"*{weights}", "sorted_ids_ptr": "*i32",
                 "block_experts_ptr": "*i32", "num_padded_ptr": "*i64", "*": "i32"}
        constexprs = dict(GATED=gated, BLOCK_M=moe.BLOCK_M, BLOCK_N=moe.BLOCK_N, BLOCK_K=moe.BLOCK_K)
        options = {"num_warps": moe.NUM_WARPS, "num_stages": moe.NUM_STAGES}
        yield f"fused_moe {dtype} {'gate_up' if gated else 'down'} weights {weights}", moe._moe_gemm_kernel, \
            types, constexprs, options


CHECK = """
import sys
from tests.kernels.sm90_compile import compile_for_sm90
from {module} import {cases} as cases

failures = 0
for name, kernel, types, constexprs, options in cases():
    try:
        print(f"{{name}}: ok {{compile_for_sm90(kernel, types, constexprs, **options)}}", flush=True)
    except Exception as exc:  # report every failing configuration, not just the first
        failures += 1
        print(f"{{name}}: FAILED {{type(exc).__name__}}: {{exc}}", flush=True)
sys.exit(1 if failures else 0)
"""


def _compiles_without_spills(module: str, cases: str) -> None:
    """Without spills: ptxas' report of each configuration (no report where ptxas is absent)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK.format(module=module, cases=cases)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert all(" 0 bytes spill stores" in line for line in run.stdout.splitlines() if "spill" in line), run.stdout


@pytest.mark.slow
def test_the_moe_kernel_compiles_for_sm90_without_spills():
    _compiles_without_spills("tests.kernels.test_sm90_compile", "moe_cases")


@pytest.mark.slow
def test_the_attention_kernels_compile_for_sm90_without_spills():
    """Every tiling the launcher picks, with the window always on and the soft-cap in Gemma's shapes."""
    _compiles_without_spills("tests.kernels.sm90_compile", "attention_cases")

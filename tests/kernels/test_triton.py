"""The Triton kernels on CPU: triton/ in a fresh pytest process under Triton's interpreter, and
without the interpreter a clear refusal.

Triton fixes interpret-or-compile when it decorates a function (triton.language's helpers when
triton is first imported), and in the suite's process transformers has imported triton long before
any kernel test runs. A process of their own, started with TRITON_INTERPRET=1, gives the kernel
tests the interpreter whatever else the suite imports.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NO_TESTS_COLLECTED = 5  # pytest's exit code when a marker expression deselects them all


@pytest.mark.timeout(1800)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process collects triton/ itself")
def test_the_triton_kernels_match_their_twins_in_an_interpreted_process(request):
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton")]
    if request.config.option.markexpr:
        command += ["-m", request.config.option.markexpr]
    run = subprocess.run(command, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, timeout=1700)
    print(run.stdout[-3000:])
    assert run.returncode in (0, NO_TESTS_COLLECTED), run.stdout[-8000:] + run.stderr[-3000:]


REFUSAL = """
import torch
from batchapi.kernels import build_rope_cache, get_ops
from tests.kernels.paged import make_case

ops = get_ops("triton", "cpu")
case = make_case([1, 3], [5, 9], 4, 2, 64)
x, cos_sin = torch.randn(3, 128), build_rope_cache(64, 16, 10000.0, None, "cpu", torch.float32)
key = case.q[:, :2]
launches = {
    "paged_attention": lambda: ops.paged_attention(*case.args(), case.scale),
    "store_kvcache": lambda: ops.store_kvcache(key, key, case.k_cache, case.v_cache, torch.arange(4)),
    "rms_norm": lambda: ops.rms_norm(x, torch.randn(128), 1e-5),
    "rotary": lambda: ops.rotary(case.q, key, torch.arange(4), cos_sin),
    "silu_and_mul": lambda: ops.silu_and_mul(x),
    "apply_token_bitmask": lambda: ops.apply_token_bitmask(x, torch.zeros(2, 4, dtype=torch.int32), [0, 2]),
}
for name, launch in launches.items():
    try:
        launch()
    except AssertionError as exc:
        assert "TRITON_INTERPRET=1" in str(exc), f"{name}: {exc}"
    else:
        raise SystemExit(f"{name} launched compiled Triton on CPU tensors")
"""


def test_without_the_interpreter_the_launchers_refuse_cpu_tensors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", REFUSAL], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

"""Every Triton kernel compiles for sm_90 (H100/H200) in the launchers' configurations, without a GPU.

The interpreter runs kernels as numpy and so cannot catch errors of compiled Triton (types of
loop-carried values, tl.dot shapes); this does. `python -m tests.kernels.sm90_compile` prints
ptxas' register and spill counts as well.
"""

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

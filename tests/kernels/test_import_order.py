"""The Triton kernels run on CPU whatever imported triton first and whether TRITON_INTERPRET was set.

Triton fixes interpret-or-compile at decoration time, and in a whole-suite run other test modules
import transformers (which imports triton) before this directory's conftest sets the variable.
Each case runs in a fresh interpreter so that the import order is the one under test.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import os
os.environ.pop("TRITON_INTERPRET", None)
{before}
import torch
from batchapi.kernels import TORCH_OPS, get_ops
from tests.kernels.paged import make_case
ops = get_ops("triton", "cpu")
x, w = torch.randn(3, 64), torch.randn(64)
torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), TORCH_OPS.rms_norm(x, w, 1e-5))
case = make_case([1, 4], [9, 20], 4, 2, 64)
torch.testing.assert_close(ops.paged_attention(*case.args(), case.scale),
                           TORCH_OPS.paged_attention(*case.args(), case.scale), atol=1e-5, rtol=1e-5)
"""
ORDERS = {  # the third order, variable set first, is how the rest of this directory runs
    "triton imported, then the variable set": "import triton\nos.environ['TRITON_INTERPRET'] = '1'",
    "variable never set": "import triton",
}


@pytest.mark.parametrize("order", ORDERS)
def test_kernels_run_on_cpu_in_any_import_order(order):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT.format(before=ORDERS[order])], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]

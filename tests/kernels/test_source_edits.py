"""The Triton kernels run on CPU when their source files change after import.

Triton's interpreter used to read a kernel's source at its first launch, not at import. In a
whole-suite run the working tree changed under the running tests (a commit moved attention.py's
lines down by one), and the split-KV merge kernel, first launched after that, was rewritten from
the main kernel's lines: KeyError '_merge_splits_kernel'. Each case edits a copy of the package in
a fresh interpreter, in both ways the kernels get decorated (see test_import_order).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, sys
from pathlib import Path
os.environ.pop("TRITON_INTERPRET", None)
{before}
sys.path.append({root!r})
import torch
from batchapi.kernels import TORCH_OPS, get_ops
from tests.kernels.paged import make_case
ops = get_ops("triton", "cpu")
kernels = Path(sys.modules["batchapi.kernels"].__file__).parent
assert kernels.is_relative_to(os.getcwd()), f"edits only the copy, not {{kernels}}"
case = make_case([1, 1], [300, 200], 4, 2, 64)
def check(num_splits):
    torch.testing.assert_close(ops.paged_attention(*case.args(), case.scale, num_splits=num_splits),
                               TORCH_OPS.paged_attention(*case.args(), case.scale), atol=1e-5, rtol=1e-5)
check(1)
for path in kernels.glob("*.py"):
    path.write_text("# edited after import: every line below moves down one\\n" + path.read_text())
check(2)  # the merge kernel's first launch
x, w = torch.randn(3, 64), torch.randn(64)
torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), TORCH_OPS.rms_norm(x, w, 1e-5))
"""
ORDERS = {
    "variable set first": "os.environ['TRITON_INTERPRET'] = '1'",
    "triton imported, variable never set": "import triton",
}


@pytest.mark.parametrize("order", ORDERS)
def test_kernels_run_the_source_they_were_imported_with(order, tmp_path):
    (tmp_path / "batchapi").mkdir()
    (tmp_path / "batchapi" / "__init__.py").touch()
    shutil.copytree(ROOT / "batchapi" / "kernels", tmp_path / "batchapi" / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    script = SCRIPT.format(before=ORDERS[order], root=str(ROOT))
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]

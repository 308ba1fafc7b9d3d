"""The Triton kernels on CPU, under Triton's interpreter, in a process started with TRITON_INTERPRET=1.

Triton chooses interpret-or-compile as it decorates a function, and triton.language's own helpers
are decorated when triton is first imported: the variable must be in the environment before
anything imports triton (transformers does). tests/kernels/test_triton.py starts such a process for
this directory; the suite's own process does not collect it (tests/kernels/conftest.py).

The interpreter reads a kernel's source when the kernel first runs, from the file as it is then:
a commit during a long run would hand it other lines (a KeyError naming another kernel, or other
code run silently). So every kernel's source is read here, once, as the session starts.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    raise pytest.UsageError("tests/kernels/triton runs the Triton kernels under Triton's interpreter: start pytest "
                            "with TRITON_INTERPRET=1 in the environment (tests/kernels/test_triton.py does)")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from batchapi.kernels.triton import activation, attention, bitmask, kvcache, matmul, moe, norm, rotary  # noqa: E402


def _read_kernel_sources() -> None:
    for module in (activation, attention, bitmask, kvcache, matmul, moe, norm, rotary):
        for value in list(vars(module).values()):
            if isinstance(value, InterpretedFunction):
                value.rewrite()  # the interpreter's own first step of a launch, from the source as it is now


_read_kernel_sources()

"""The Triton kernels run on CPU through Triton's interpreter in these tests.

Triton decides interpret-or-compile when a kernel is decorated, so the variable is set here, at
import, before any test module imports batchapi's Triton modules; the launchers also fall back to
the interpreter for CPU tensors if something imported them earlier.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

"""The kernel tests: torch/, cpu/ and triton/ mirror batchapi/kernels; paged.py, random_model.py and
march.py build their cases; sm90_compile.py compiles the Triton kernels for a GPU.

triton/ runs the Triton kernels on CPU under Triton's interpreter, which must be chosen before
anything imports triton (see triton/conftest.py). A process started without TRITON_INTERPRET=1, as
the suite's is, does not collect triton/: test_triton.py runs it in a pytest process of its own.
"""

import os

collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["triton"]

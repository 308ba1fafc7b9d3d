"""Launch helpers shared by the Triton launchers."""

import functools
import inspect
import textwrap

import torch
import triton
from triton.runtime.interpreter import FunctionRewriter, InterpretedFunction
from triton.runtime.jit import JITFunction


class _ImportedSourceRewriter(FunctionRewriter):
    """Triton's interpreter rewrite, from the kernel's source as it was imported.

    Triton's own rewriter reads the source from the file at the first interpreted launch, long after
    import; a file edited in between (the working tree of a long test run) gives it another
    function's lines: a KeyError naming the kernel, or silently different code. Compiled Triton
    keeps the source from decoration (JITFunction.src); this does the same for the interpreter.
    """

    def __init__(self, fn, src: str, def_line: int, **kwargs):
        super().__init__(fn, **kwargs)
        self.src, self.def_line = src, def_line  # src starts at `def`, on line def_line of its file

    def rewrite_ast(self):
        self.filename, self.def_file_lineno = self.fn.__code__.co_filename, self.def_line
        return self._compile_and_exec(self._transform_ast(self.src))


def _source_from_def(fn) -> tuple[str, int]:
    lines, first_line = inspect.getsourcelines(fn)
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    return textwrap.dedent("".join(lines[at:])), first_line + at


def jit(fn=None, **options):
    """triton.jit for our kernels: the interpreter runs the source read at import, as compiled Triton does.

    Under TRITON_INTERPRET=1 triton.jit returns an InterpretedFunction, which would read the source
    only at its first launch; the source is read here instead, while the module is imported.
    """
    if fn is None:
        return functools.partial(jit, **options)
    kernel = triton.jit(fn, **options)
    if isinstance(kernel, InterpretedFunction):
        kernel.rewriter = _ImportedSourceRewriter(fn, *_source_from_def(fn), **kernel.kwargs)
    return kernel


_interpreted: dict = {}  # JITFunction.fn -> its InterpretedFunction (a JITFunction's own hash is costly)


def _interpreted_twin(kernel: JITFunction) -> InterpretedFunction:
    interpreted = _interpreted.get(kernel.fn)
    if interpreted is None:
        interpreted = InterpretedFunction(kernel.fn)
        interpreted.rewriter = _ImportedSourceRewriter(kernel.fn, kernel.src, kernel.def_file_line_number)
        _interpreted[kernel.fn] = interpreted
    return interpreted


def _call_interpreted(self, *args, **kwargs):
    return _interpreted_twin(self)(*args, **kwargs)


def for_device(kernel, tensor: torch.Tensor):
    """The kernel for tensor's device: compiled on GPU, Triton's interpreter on CPU.

    Triton picks interpret-or-compile when a function is decorated (from TRITON_INTERPRET), both for
    our kernels and for triton.language's own helpers (tl.sum, tl.cdiv ...), which are decorated
    when triton is first imported. When that import came before the variable was set (transformers
    imports triton, for one), kernels on CPU tensors are wrapped in the interpreter here, and the
    compiled helpers they call are routed to the interpreter too: JITFunction.__call__ otherwise
    only raises "Cannot call @triton.jit'd outside of the scope of a kernel" (the compiler itself
    never calls it, so GPU launches are unaffected). Either way the interpreter runs the source
    captured at import (see jit).
    """
    if tensor.device.type != "cpu":
        return kernel
    JITFunction.__call__ = _call_interpreted
    if isinstance(kernel, InterpretedFunction):
        assert isinstance(kernel.rewriter, _ImportedSourceRewriter), f"{kernel.__name__}: decorate with launch.jit"
        return kernel
    return _interpreted_twin(kernel)


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}"


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on different devices: {devices}"


def next_pow2(n: int) -> int:
    # plain Python: triton.next_power_of_2 is a constexpr function, slow to call from the host
    return 1 << (n - 1).bit_length() if n > 1 else 1

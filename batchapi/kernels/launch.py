"""Launch helpers shared by the Triton launchers."""

import functools

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


@functools.cache
def _interpreted(fn):
    return InterpretedFunction(fn)


def _call_interpreted(self, *args, **kwargs):
    return _interpreted(self.fn)(*args, **kwargs)


def for_device(kernel, tensor: torch.Tensor):
    """The kernel for tensor's device: compiled on GPU, Triton's interpreter on CPU.

    Triton picks interpret-or-compile when a function is decorated (from TRITON_INTERPRET), both for
    our kernels and for triton.language's own helpers (tl.sum, tl.cdiv ...), which are decorated
    when triton is first imported. When that import came before the variable was set (transformers
    imports triton, for one), kernels on CPU tensors are wrapped in the interpreter here, and the
    compiled helpers they call are routed to the interpreter too: JITFunction.__call__ otherwise
    only raises "Cannot call @triton.jit'd outside of the scope of a kernel" (the compiler itself
    never calls it, so GPU launches are unaffected).
    """
    if tensor.device.type != "cpu":
        return kernel
    JITFunction.__call__ = _call_interpreted
    return kernel if isinstance(kernel, InterpretedFunction) else _interpreted(kernel.fn)


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}"


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on different devices: {devices}"


def next_pow2(n: int) -> int:
    # plain Python: triton.next_power_of_2 is a constexpr function, slow to call from the host
    return 1 << (n - 1).bit_length() if n > 1 else 1

"""Checks and helpers shared by the Triton launchers."""

import torch
import triton


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Compiled Triton runs on CUDA tensors only; Triton's interpreter (the tests) runs on CPU ones.

    Triton picks interpret-or-compile as it decorates a function, triton.language's own helpers when
    triton is first imported: TRITON_INTERPRET=1 must be set before anything imports triton."""
    assert tensor.is_cuda or not isinstance(kernel, triton.JITFunction), (
        f"{kernel.__name__}: compiled Triton kernels take CUDA tensors, got {tensor.device}; on CPU run them under "
        "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported) or use kernel mode cpu or torch"
    )


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}"


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on different devices: {devices}"


def next_pow2(n: int) -> int:
    # plain Python: triton.next_power_of_2 is a constexpr function, slow to call from the host
    return 1 << (n - 1).bit_length() if n > 1 else 1

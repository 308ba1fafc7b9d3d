"""The Triton SiLU-and-mul kernel (kernels.triton.activation, interpreted on CPU) against its twin."""

import pytest
import torch

from batchapi.kernels import TORCH_OPS
from batchapi.kernels.triton import activation

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}  # exp's implementation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_twin(dtype):
    x = torch.randn(3, 2 * 1500).to(dtype)  # two column blocks, the second ragged
    torch.testing.assert_close(activation.silu_and_mul(x), TORCH_OPS.silu_and_mul(x), atol=TOL[dtype], rtol=TOL[dtype])

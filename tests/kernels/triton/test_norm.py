"""The Triton RMSNorm kernels (kernels.triton.norm, interpreted on CPU) against their twins.

Tolerances: fp32 1e-5 and fp16 1e-3, from reduction order and rsqrt; the kernel rounds at the same
places as the twins, so most results are bit-equal.
"""

import random

import pytest
import torch

from batchapi.kernels import TORCH_OPS
from batchapi.kernels.triton import norm

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(2))
def test_norms_match_twin(seed, dtype):
    rng = random.Random(seed)
    n, hidden = rng.randint(1, 6), rng.choice([64, 96, 576])
    x, res, w = torch.randn(n, hidden).to(dtype), torch.randn(n, hidden).to(dtype), torch.randn(hidden).to(dtype)
    tol = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-5), TORCH_OPS.rms_norm(x, w, 1e-5), **tol)
    normed, summed = norm.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_summed = TORCH_OPS.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(normed, ref_normed, **tol)
    assert torch.equal(summed, ref_summed)

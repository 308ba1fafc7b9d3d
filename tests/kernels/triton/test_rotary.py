"""The Triton rotary kernel (kernels.triton.rotary, interpreted on CPU) against its twin."""

import pytest
import torch

from batchapi.kernels import TORCH_OPS, build_rope_cache
from batchapi.kernels.triton import rotary

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}])
def test_rotary_matches_twin_on_qkv_views(dtype, scaling):
    hq, hkv, d, n = 5, 1, 64, 4
    cos_sin = build_rope_cache(d, 4096, 500000.0, scaling, "cpu", torch.float32)
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)  # the engine's fused projection, split by views
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    positions = torch.tensor([0, 1, 1000, 4095])
    for out, ref in zip(rotary.rotary(q, k, positions, cos_sin), TORCH_OPS.rotary(q, k, positions, cos_sin),
                        strict=True):
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])

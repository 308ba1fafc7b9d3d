"""The Triton KV store (kernels.triton.kvcache, interpreted on CPU) against its twin: bit-equal."""

import pytest
import torch

from batchapi.kernels import TORCH_OPS
from batchapi.kernels.triton import kvcache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_matches_twin(dtype):
    g = torch.Generator().manual_seed(0)
    n, hkv, d = 6, 3, 64
    kv = torch.randn(n, 2 * hkv * d, generator=g).to(dtype)
    key, value = kv[:, : hkv * d].view(n, hkv, d), kv[:, hkv * d :].view(n, hkv, d)
    slots = torch.tensor([5, -1, 160, 31, -1, 17], dtype=torch.int64)
    caches = [torch.zeros(11, 16, hkv, d, dtype=dtype) for _ in range(4)]
    kvcache.store_kvcache(key, value, caches[0], caches[1], slots)
    TORCH_OPS.store_kvcache(key, value, caches[2], caches[3], slots.int())
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int(caches[0].count_nonzero()) == 4 * hkv * d

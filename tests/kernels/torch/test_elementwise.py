"""The elementwise twins (kernels.torch.elementwise) against transformers' Llama modules and torch.argmax."""

import pytest
import torch

from batchapi.kernels.torch import elementwise
from tests.kernels.torch.llama import llama_config


def test_store_kvcache_skips_negative_slots():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    elementwise.store_kvcache(key, value, k_cache, v_cache, torch.tensor([13, -1, 2], dtype=torch.int32))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[0, 2], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_mlp_match_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    norm = LlamaRMSNorm(128, eps=1e-5).to(dtype)
    norm.weight.data.normal_()
    x, res = torch.randn(7, 128).to(dtype), torch.randn(7, 128).to(dtype)
    assert torch.equal(elementwise.rms_norm(x, norm.weight, 1e-5), norm(x))
    normed, summed = elementwise.fused_add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(summed, x + res) and torch.equal(normed, norm(x + res))

    mlp = LlamaMLP(llama_config()).to(dtype)
    h = torch.randn(7, 128).to(dtype)
    gate_up = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1)  # [N, 2I]
    expected = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
    assert torch.equal(elementwise.silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_with_ties_nan_and_inf(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 3, (16, 4096), generator=g).to(dtype)  # many ties across chunks
    x[3, 2000] = x[3, 100] = float("nan")
    x[5] = float("-inf")
    x[6, 4095] = 10
    assert elementwise.argmax(x).tolist() == x.argmax(-1).tolist()


def test_argmax_of_rows_it_cannot_chunk_is_torchs():
    g = torch.Generator().manual_seed(1)
    wide = torch.randint(-3, 3, (7, 1001 + 64), generator=g).float()
    for x in (wide[:, 32:1033], wide[:, :1024], torch.zeros(0, 1024)):  # odd width, strided rows, no rows
        assert elementwise.argmax(x).tolist() == x.argmax(-1).tolist()

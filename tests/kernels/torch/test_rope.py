"""The rotary cache (kernels.torch.rope) and the rotary twin against transformers' Llama rotary embedding."""

import pytest
import torch

from batchapi.kernels.torch import elementwise
from batchapi.kernels.torch.rope import build_rope_cache
from tests.kernels.torch.llama import llama_config


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},  # within the trained context: the default frequencies
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
         "mscale": 0.707, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 1.3,
         "truncate": False},
        {"type": "linear", "factor": 2.0},  # the older key
    ],
    ids=["default", "llama3", "linear", "dynamic", "yarn", "yarn-mscale", "yarn-factor-untruncated", "type-key"],
)
def test_rope_and_rotary_match_transformers(rope_scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    theta = 500000.0
    params = {"rope_type": "default", "rope_theta": theta} if rope_scaling is None else {**rope_scaling, "rope_theta": theta}
    if "type" in params:
        params["rope_type"] = params.pop("type")
    hf = LlamaRotaryEmbedding(llama_config(rope_parameters=params, max_position_embeddings=512))
    cos_sin = build_rope_cache(64, 512, theta, rope_scaling, "cpu", torch.float32, 512)
    positions = torch.tensor([0, 1, 7, 300, 511])
    q, k = torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    cos, sin = hf(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = elementwise.rotary(q, k, positions, cos_sin)
    assert torch.equal(cos_sin[positions, :32], cos[0, :, :32])
    assert torch.equal(cos_sin[positions, 32:], sin[0, :, :32])
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), atol=0, rtol=0)


def test_dynamic_rope_is_refused_past_the_trained_context():
    with pytest.raises(AssertionError, match="past the trained 512"):
        build_rope_cache(64, 1024, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, "cpu", torch.float32, 512)

"""Rotary cos/sin cache, computed exactly as transformers' LlamaRotaryEmbedding does."""

import math

import torch


def _default_inv_freq(head_dim: int, base: float, device) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    return 1.0 / (base ** (exponents / head_dim))  # [D/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


def rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def build_rope_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None,
    device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """cos_sin [max_position, head_dim]: first head_dim/2 columns cos, last head_dim/2 sin.

    rope_scaling is the HF config's rope_scaling / rope_parameters dict (or None). Supported
    rope_type: "default" and "llama3"; a "rope_theta" key in it overrides base.
    """
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    kind = rope_type(rope_scaling)
    assert kind in ("default", "llama3"), f"unsupported rope_type {kind!r}"
    if rope_scaling and rope_scaling.get("rope_theta") is not None:
        base = rope_scaling["rope_theta"]
    inv_freq = _default_inv_freq(head_dim, base, device)  # [D/2] fp32
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2] fp32, same rounding as HF
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)  # [P, D]

"""Rotary cos/sin cache, computed exactly as transformers' rotary embeddings do
(``transformers.modeling_rope_utils``: default, linear, dynamic, yarn, llama3)."""

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


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict, max_position_embeddings: int,
                   device) -> tuple[torch.Tensor, float]:
    """YaRN: the low frequencies interpolated by ``factor``, the high ones kept, a linear ramp between
    (by the number of rotations in the original context, ``beta_fast`` and ``beta_slow``); cos and sin
    scaled by the attention factor."""
    dim = head_dim
    factor = scaling.get("factor")
    original = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)  # [D/2]
    extrapolation = 1 - ramp  # 1: the frequency is kept as it was trained
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


KINDS = ("default", "linear", "dynamic", "yarn", "llama3")


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
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """cos_sin [max_position, head_dim]: first head_dim/2 columns cos, last head_dim/2 sin.

    rope_scaling is the HF config's rope_scaling / rope_parameters dict (or None), of a ``KINDS``
    rope_type; a "rope_theta" key in it overrides base. ``max_position_embeddings`` is the
    config's (yarn without a factor derives it from there; dynamic needs it). "dynamic" (NTK)
    changes nothing within the trained context, and beyond it transformers scales by the longest
    sequence of the batch, which no batch-invariant engine can follow: so ``max_position`` may not
    pass ``max_position_embeddings`` there.
    """
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    kind = rope_type(rope_scaling)
    assert kind in KINDS, f"unsupported rope_type {kind!r}"
    if rope_scaling and rope_scaling.get("rope_theta") is not None:
        base = rope_scaling["rope_theta"]
    attention_factor = 1.0
    inv_freq = _default_inv_freq(head_dim, base, device)  # [D/2] fp32
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif kind == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif kind == "dynamic":
        assert max_position_embeddings is not None and max_position <= max_position_embeddings, (
            f"dynamic rope up to {max_position} positions, past the trained {max_position_embeddings}")
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(head_dim, base, rope_scaling, max_position_embeddings, device)
    positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2] fp32, same rounding as HF
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1).to(dtype)  # [P, D]

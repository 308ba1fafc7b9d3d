"""Pure-torch twins of the elementwise kernels and of the greedy argmax: the fallback and the test oracle.

They follow transformers' Llama modules operation for operation (same dtypes at each step), so
an engine running them gives the same numbers as Hugging Face on the same device.
"""

import torch
import torch.nn.functional as F


def store_kvcache(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int, -1 = skip
) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, value.to(v_flat.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # [N, H]
    variance = x32.pow(2).mean(-1, keepdim=True)  # [N, 1]
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual  # [N, H], in the activation dtype as HF adds it
    return rms_norm(summed, weight, eps), summed


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, H, D]; cos, sin [N, 1, D/2]; neox halves layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    positions: torch.Tensor,  # [N] int64
    cos_sin: torch.Tensor,  # [max_pos, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.long()).to(q.dtype)  # [N, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [N, 1, D/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_store(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    positions: torch.Tensor,  # [N] int64
    cos_sin: torch.Tensor,  # [max_pos, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int, -1 = skip
) -> torch.Tensor:
    """rotary, then store_kvcache of the rotated k and of v; returns the rotated q."""
    q, k = rotary(q, k, positions, cos_sin)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [N, I] each
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [N, I] each
    return F.gelu(gate, approximate="tanh") * up  # Gemma's gelu_pytorch_tanh


def argmax(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """x.argmax(-1) of [B, V] logits, same index (first of ties, NaN counts as the largest), faster on CPU.

    On CPU argmax over the vocabulary costs ~10x an amax: find the first chunk of the row that holds
    its maximum through vectorised amax, then run argmax on that chunk alone."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab % chunk or not x.is_contiguous() or rows == 0:
        return x.argmax(dim=-1)
    chunks = x.view(rows, vocab // chunk, chunk)  # [B, C, chunk]
    chunk_max = chunks.amax(dim=-1)  # [B, C]
    row_max = chunk_max.amax(dim=-1, keepdim=True)  # [B, 1]
    # argmax counts NaN as the largest value; amax propagates it, so a NaN chunk is the one
    holds = (chunk_max == row_max) | chunk_max.isnan()
    first = holds.byte().argmax(dim=-1)  # [B] first chunk holding the maximum
    picked = chunks[torch.arange(rows), first]  # [B, chunk]
    return first * chunk + picked.argmax(dim=-1)

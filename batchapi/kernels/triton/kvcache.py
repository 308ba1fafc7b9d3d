"""Store this step's keys and values into the paged cache through a slot mapping (-1 = skip)."""

import torch
import triton
import triton.language as tl

from batchapi.kernels.triton.launch import (
    check_last_dim_contiguous,
    check_launchable,
    check_same_device,
    next_pow2,
)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,  # [N, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [N]
    stride_kn, stride_kh,
    stride_vn, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, HEAD_DIM)
    ok = (heads < NUM_KV_HEADS)[:, None]
    src = heads[:, None] * stride_kh + dims[None, :]
    key = tl.load(key_ptr + token * stride_kn + src, mask=ok)  # [Hkv, D]
    value = tl.load(value_ptr + token * stride_vn + heads[:, None] * stride_vh + dims[None, :], mask=ok)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=ok)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value [N, Hkv, D] into k_cache, v_cache [num_blocks, block_size, Hkv, D], in place."""
    assert key.dim() == 3 and key.shape == value.shape, f"key {tuple(key.shape)} / value {tuple(value.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share strides"
    assert key.shape[1:] == k_cache.shape[2:], f"key heads/dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}"
    assert slot_mapping.shape == (key.shape[0],), f"slot_mapping {tuple(slot_mapping.shape)} for {key.shape[0]} tokens"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {slot_mapping.dtype}"
    head_dim = k_cache.shape[3]
    assert head_dim == next_pow2(head_dim), f"head dim {head_dim} must be a power of 2"
    check_last_dim_contiguous(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
    check_same_device(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    check_launchable(_store_kvcache_kernel, key)
    _store_kvcache_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_P2=next_pow2(k_cache.shape[2]),
    )

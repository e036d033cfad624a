"""Triton kernel that stores a step's new K and V in their paged-cache slots.

The cache of one layer is ``(num_blocks, block_size, n_kv_heads, head_dim)``
and contiguous, so it is also a flat array of ``num_blocks * block_size``
slots. Token ``t`` goes to slot ``slot_mapping[t]``; a negative slot marks a
padding token (a CUDA-graph batch padded to its captured size) and is
skipped.

Import this module after setting ``TRITON_INTERPRET=1`` to run it on CPU
tensors: Triton decides between compiling and interpreting when a kernel
is decorated, i.e. at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    cache_stride_slot, cache_stride_head,
    NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
):
    # One program per token: all its kv heads at once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_P)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
    dst = slot * cache_stride_slot + heads[:, None] * cache_stride_head + dims[None, :]
    k = tl.load(key_ptr + t * k_stride_t + heads[:, None] * k_stride_h + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + t * v_stride_t + heads[:, None] * v_stride_h + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches: same 4-d shape, dtype and device, contiguous."""
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be (num_blocks, block_size, n_kv_heads, head_dim), got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in SUPPORTED_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtypes must match and be one of {SUPPORTED_DTYPES}, got {k_cache.dtype}, {v_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache on {k_cache.device}, v_cache on {v_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def check_index(name: str, tensor: torch.Tensor, dims: int, device: torch.device) -> None:
    """An int32/int64 index tensor with ``dims`` dimensions on ``device``."""
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the cache on {device}")
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def check_tokens(name: str, tensor: torch.Tensor, heads: int, head_dim: int, cache: torch.Tensor) -> None:
    """A ``(T, heads, head_dim)`` tensor of the cache's dtype and device, unit stride in the last dim."""
    if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (heads, head_dim):
        raise ValueError(f"{name} must be (T, {heads}, {head_dim}), got shape {tuple(tensor.shape)}")
    if tensor.dtype != cache.dtype:
        raise ValueError(f"{name} dtype {tensor.dtype} != cache dtype {cache.dtype}")
    if tensor.device != cache.device:
        raise ValueError(f"{name} is on {tensor.device}, the cache on {cache.device}")
    if tensor.shape[0] > 0 and tensor.stride(2) != 1:
        raise ValueError(f"{name} must have unit stride in head_dim, got strides {tensor.stride()}")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``, ``value`` ``(T, kvh, d)`` at cache slots ``slot_mapping (T,)``.

    Negative slots are skipped. Raises ``ValueError`` on a shape, dtype,
    device or layout the kernel cannot take.
    """
    check_cache_pair(k_cache, v_cache)
    kvh, head_dim = k_cache.shape[2:]
    check_tokens("key", key, kvh, head_dim, k_cache)
    check_tokens("value", value, kvh, head_dim, k_cache)
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=kvh, HEADS_P=triton.next_power_of_2(kvh),
        HEAD_DIM=head_dim, HEAD_P=triton.next_power_of_2(head_dim),
    )

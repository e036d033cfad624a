"""Fused Triton kernels of the CUDA decoder layer: fewer, fatter launches.

    rms_norm            out = weight * norm(x)
    fused_add_rms_norm  residual += x; x = weight * norm(residual)   (in place)
    silu_mul            out = silu(gate) * up                        (gate_up = [gate | up])
    rope_write_kv       rotate q in place; rotate k, store k and v in the paged cache

Numerics (so the CUDA path matches the torch one bit for bit, or nearly):
all arithmetic is float32, and results are rounded (to nearest even) to the
activation dtype where torch would round them. RMSNorm rounds twice, as
``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`` does, with IEEE
sqrt and division for the rsqrt; the residual add of ``fused_add_rms_norm``
is rounded before it is normalised; SiLU·mul and the rotation round once.
Only the order of the sum of squares (and, compiled, FMA contraction) differs
from torch, so float32 results agree to a few ulp. A norm program owns one
whole row, and its block size and warp count depend on the hidden size only,
so a row's bits never depend on the batch it came in (batch invariance).

No wrapper reads a device value or allocates anything but its output, so
every call can be captured in a CUDA graph. Wrappers raise ``ValueError``
on a shape, dtype, device or layout the kernel cannot take.

Import this module after setting ``TRITON_INTERPRET=1`` to run it on CPU
tensors: Triton decides between compiling and interpreting at decoration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# A norm program holds its whole row in registers.
MAX_HIDDEN = 65536
SILU_BLOCK = 1024


@triton.jit
def _round(x, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """float32 ``x`` rounded to ``dtype``, to nearest even (see ``_soft_bf16``)."""
    if SOFT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    return x.to(dtype)


@triton.jit
def _normalise(x, w, eps, H: tl.constexpr, SOFT_BF16: tl.constexpr):
    """x: one float32 row (0 past H); w: the weight row -> the row in w's dtype."""
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps))
    y = _round(x * rstd, w.dtype, SOFT_BF16)
    return _round(w.to(tl.float32) * y.to(tl.float32), w.dtype, SOFT_BF16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, x_stride, out_stride, eps,
    H: tl.constexpr, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, _normalise(x, w, eps, H, SOFT_BF16), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, x_stride, r_stride, eps,
    H: tl.constexpr, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(x + r, r_ptr.dtype.element_ty, SOFT_BF16)  # rounded, as torch's add; the norm reads this
    tl.store(r_ptr + row * r_stride + cols, s, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(x_ptr + row * x_stride + cols, _normalise(s.to(tl.float32), w, eps, H, SOFT_BF16), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, gu_stride, out_stride, inter, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = gu_ptr + row * gu_stride + cols
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * out_stride + cols, _round(y, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    qkv_stride, cos_sin_stride, cache_stride_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_P: tl.constexpr,
    NH_P: tl.constexpr, KVH_P: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    # One program per token, all its heads at once: q head h sits at columns
    # h * d of the token's row, k head j at (nh + j) * d, v head j at (nh + kvh + j) * d.
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF_P)
    dim_ok = dims < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + dims, mask=dim_ok, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + dims, mask=dim_ok, other=0.0)[None, :]
    row = qkv_ptr + t * qkv_stride
    dtype = qkv_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    qh = tl.arange(0, NH_P)[:, None]
    q_ok = (qh < NUM_HEADS) & dim_ok[None, :]
    q = row + qh * HEAD_DIM + dims[None, :]
    x1 = tl.load(q, mask=q_ok, other=0.0).to(tl.float32)
    x2 = tl.load(q + HALF, mask=q_ok, other=0.0).to(tl.float32)
    tl.store(q, _round(x1 * cos - x2 * sin, dtype, SOFT_BF16), mask=q_ok)
    tl.store(q + HALF, _round(x2 * cos + x1 * sin, dtype, SOFT_BF16), mask=q_ok)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative: a padding token, not cached
        kh = tl.arange(0, KVH_P)[:, None]
        kv_ok = (kh < NUM_KV_HEADS) & dim_ok[None, :]
        k = row + (NUM_HEADS + kh) * HEAD_DIM + dims[None, :]
        v = k + NUM_KV_HEADS * HEAD_DIM
        dst = slot * cache_stride_slot + kh * HEAD_DIM + dims[None, :]
        k1 = tl.load(k, mask=kv_ok, other=0.0).to(tl.float32)
        k2 = tl.load(k + HALF, mask=kv_ok, other=0.0).to(tl.float32)
        tl.store(k_cache_ptr + dst, _round(k1 * cos - k2 * sin, dtype, SOFT_BF16), mask=kv_ok)
        tl.store(k_cache_ptr + dst + HALF, _round(k2 * cos + k1 * sin, dtype, SOFT_BF16), mask=kv_ok)
        tl.store(v_cache_ptr + dst, tl.load(v, mask=kv_ok), mask=kv_ok)
        tl.store(v_cache_ptr + dst + HALF, tl.load(v + HALF, mask=kv_ok), mask=kv_ok)


def _check_rows(name: str, tensor: torch.Tensor, width: int | None = None, like: torch.Tensor | None = None) -> None:
    """A 2-d activation, unit stride in the last dim; with ``like``: its rows, dtype and device."""
    if tensor.dim() != 2 or (width is not None and tensor.shape[1] != width):
        want = f"(T, {width})" if width is not None else "(T, width)"
        raise ValueError(f"{name} must be {want}, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be one of {SUPPORTED_DTYPES}, got {tensor.dtype}")
    if like is not None and tensor.shape[0] != like.shape[0]:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {like.shape[0]}")
    if like is not None and (tensor.dtype, tensor.device) != (like.dtype, like.device):
        raise ValueError(f"{name} dtype {tensor.dtype} on {tensor.device} != {like.dtype} on {like.device}")
    if tensor.numel() > 0 and tensor.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {tensor.stride()}")


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    hidden = x.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be ({hidden},), got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != activation dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, the activations on {x.device}")
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {MAX_HIDDEN}], got {hidden}")


def _soft_bf16(dtype: torch.dtype) -> bool:
    """Whether float32 -> bfloat16 is rounded by hand (bit arithmetic).

    Only under the interpreter: Triton 3.9's interpreter truncates that cast
    where compiled kernels (and torch) round to nearest even.
    """
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _norm_launch(x: torch.Tensor) -> dict[str, int]:
    """Block and warps from the hidden size alone (batch invariance)."""
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    return {"H": hidden, "BLOCK": block, "SOFT_BF16": _soft_bf16(x.dtype), "num_warps": warps}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             check: bool = True) -> torch.Tensor:
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`` of ``x (T, H)`` -> ``(T, H)``.

    ``weight (H,)`` has x's dtype. ``out`` (optional, ``(T, H)``, unit stride
    in H) may not overlap x unless it is x itself.
    """
    if check:
        _check_rows("x", x)
        _check_weight(weight, x)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif check:
        _check_rows("out", out, x.shape[1], like=x)
    if x.shape[0] > 0:
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), eps, **_norm_launch(x))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       check: bool = True) -> None:
    """In place: ``residual = x + residual`` (rounded), then ``x = rms_norm(residual)``.

    ``x``, ``residual (T, H)``: same dtype and device, unit stride in H,
    not overlapping. The norm reads the rounded new residual.
    """
    if check:
        _check_rows("x", x)
        _check_rows("residual", residual, x.shape[1], like=x)
        _check_weight(weight, x)
        if x.shape[0] > 0 and x.data_ptr() == residual.data_ptr():
            raise ValueError("x and residual must be different tensors")
    if x.shape[0] > 0:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, x.stride(0), residual.stride(0), eps, **_norm_launch(x)
        )


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up (T, 2I) = [gate | up]`` -> ``(T, I)``, rounded once."""
    if check:
        _check_rows("gate_up", gate_up)
        if gate_up.shape[1] % 2 != 0:
            raise ValueError(f"gate_up width must be even (gate | up), got {gate_up.shape[1]}")
    inter = gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    elif check:
        _check_rows("out", out, inter, like=gate_up)
    if gate_up.shape[0] > 0 and inter > 0:
        grid = (gate_up.shape[0], triton.cdiv(inter, SILU_BLOCK))
        _silu_mul_kernel[grid](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=SILU_BLOCK, SOFT_BF16=_soft_bf16(out.dtype)
        )
    return out


def _check_index(name: str, tensor: torch.Tensor, rows: int, device: torch.device) -> None:
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != 1 or tensor.shape[0] != rows:
        raise ValueError(f"{name} must be ({rows},), got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, qkv on {device}")
    if rows > 0 and tensor.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def _check_rope_args(
    qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> None:
    if num_heads < 1 or num_kv_heads < 1 or head_dim < 2 or head_dim % 2 != 0:
        raise ValueError(f"need heads >= 1 and an even head_dim, got {num_heads}, {num_kv_heads}, {head_dim}")
    _check_rows("qkv", qkv, (num_heads + 2 * num_kv_heads) * head_dim)
    geometry = (num_kv_heads, head_dim)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != geometry or cache.shape != k_cache.shape:
            raise ValueError(
                f"{name} must be (num_blocks, block_size, {num_kv_heads}, {head_dim}) like k_cache, "
                f"got shape {tuple(cache.shape)}"
            )
        if cache.dtype != qkv.dtype or cache.device != qkv.device:
            raise ValueError(f"{name} is {cache.dtype} on {cache.device}, qkv {qkv.dtype} on {qkv.device}")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"cos_sin must be float32 (max_positions, {head_dim}), got {cos_sin.dtype} {tuple(cos_sin.shape)}"
        )
    if cos_sin.device != qkv.device or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin must be on {qkv.device} with unit stride in its last dim")


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    check: bool = True,
) -> None:
    """Rotary on q (in place in qkv) and k, then k and v into the paged cache.

    qkv (T, (nh + 2 kvh) d): [q | k | v] columns, unit stride in the last dim.
    positions (T,): each must be in [0, max_positions), and each slot below
    num_blocks * block_size (not checked: that would need a host sync). cos_sin (max_positions, d) float32: [cos | sin] of
    ``pos * inv_freq``. k_cache, v_cache (num_blocks, block_size, kvh, d),
    contiguous, qkv's dtype. Token t goes to slot ``slot_mapping[t]``
    (``block * block_size + offset``); a negative slot is padding, not
    stored. The rotated k lives only in the cache: qkv's k columns are left
    as they were. ``check=False`` skips the argument checks (the model
    checks its first layer's call each step; the others have the same shapes).
    """
    tokens = qkv.shape[0]
    if check:
        _check_rope_args(qkv, cos_sin, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
        _check_index("positions", positions, tokens, qkv.device)
        _check_index("slot_mapping", slot_mapping, tokens, qkv.device)
    if tokens == 0:
        return
    _rope_write_kv_kernel[(tokens,)](
        qkv, positions, cos_sin, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos_sin.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_P=triton.next_power_of_2(head_dim // 2), NH_P=triton.next_power_of_2(num_heads),
        KVH_P=triton.next_power_of_2(num_kv_heads), SOFT_BF16=_soft_bf16(qkv.dtype),
    )

"""Skinny linear layers for steps of a few tokens (CUDA): weight streaming with fused edges.

A decode step of a few sequences multiplies a handful of rows by every
weight matrix of the model: it is bound by reading the weights once, and
cuBLAS's GEMV reaches only ~55-65% of the card's bandwidth there. Its
neighbours are tiny kernels (an RMSNorm, a residual add, SiLU·mul) whose
cost is their launch latency, not their arithmetic. ``skinny_linear`` is
one Triton kernel for ``out = edge(x) @ W.T (+ bias)`` with the edges
folded in:

    prologue "norm"      x := RMSNorm(x) with the layer's norm weight (each program
                         recomputes its rows' sum of squares: x is a few KB)
    prologue "silu_mul"  x := silu(gate) * up of x = [gate | up]
    epilogue "add"       residual += out (rounded), in place; nothing else is written

so a decoder layer of a small step is six kernels (``layer_ops``):
qkv (norm), rope+cache, attention, o_proj (add), gate_up (norm), down
(silu_mul, add). Each program owns ``BLOCK_N`` output columns of
``BLOCK_M`` rows and walks K in order, ``BLOCK_K`` at a time, into one
float32 accumulator (no split-K: the result has one summation order per
config). Weights are read once per row block, so the kernel is for
``M <= MAX_ROWS``.

Numerics follow ``triton_fused``: float32 arithmetic, rounded to the
activation dtype where torch rounds (the norm twice, SiLU·mul once, the
product once after its bias, the residual add once). The sum of the
product runs in another order than cuBLAS, so results agree with
``F.linear`` to the dtype's rounding, not bit for bit.

No wrapper reads a device value or allocates anything but its output, so
every call can be captured in a CUDA graph. Import this module after
setting ``TRITON_INTERPRET=1`` to run it on CPU tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from jitney.worker.triton_fused import _round, _soft_bf16

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PROLOGUES = {"none": 0, "norm": 1, "silu_mul": 2}
# Measured alternatives (bench/gpu_kernels.py, not used by the model): "norm_late" scales each row by
# its RMS after the product (the sum of squares taken in the same loop, other rounding); "scale" only
# multiplies x by the norm weight (what an elementwise step before the product costs).
VARIANTS = {"norm_late": 3, "scale": 4}
# The most rows a skinny launch takes; above it every row block would re-read the weights.
MAX_ROWS = 64
SMEM_BYTES = 160 * 1024   # what a launch's pipeline stages may take (Hopper has 227 KB, Ampere 163 KB per block)


class SkinnyConfig(NamedTuple):
    """One launch shape: output columns per program, K per trip, warps and pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Overrides by (N, K) (bench/gpu_sweep.py measures candidates on the card).
CONFIGS: dict[tuple[int, int], SkinnyConfig] = {}


def skinny_config(n: int, k: int) -> SkinnyConfig:
    """The launch shape of an ``(M, K) @ (N, K).T`` product with ``M <= MAX_ROWS``.

    Enough programs to keep every SM streaming (narrow columns for narrow
    layers), long K trips (8 KB of weights per stage at 16 columns).
    """
    if (n, k) in CONFIGS:
        return CONFIGS[(n, k)]
    block_n = 16 if n <= 8192 else 64
    block_k = min(256, max(32, triton.next_power_of_2(k)))
    return SkinnyConfig(block_n, block_k, 4, 4)


@triton.jit(do_not_specialize=["M"])   # one binary for every row count of a row block (no compile in a step)
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, nw_ptr, out_ptr,
    M, N, K, x_stride, out_stride, eps,
    PROLOGUE: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    # program (column block, row block); x row r at x_ptr + r * x_stride (K wide, or 2K for silu_mul)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    dtype = w_ptr.dtype.element_ty
    if PROLOGUE == 1:  # the rows' RMS, as triton_fused._normalise computes it
        sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            sq += tl.sum(xk * xk, axis=1)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(sq / K + eps))
    if PROLOGUE == 3:  # (measured variant) the sum of squares rides along; the rows are scaled at the end
        sq3 = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x_mask = row_ok[:, None] & k_ok[None, :]
        if PROLOGUE == 2:
            g = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
            a = _round(g / (1.0 + tl.exp(-g)) * u, dtype, SOFT_BF16)
        else:
            a = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
            if PROLOGUE == 1:
                y = _round(a.to(tl.float32) * rstd[:, None], dtype, SOFT_BF16)
                nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = _round(nw[None, :] * y.to(tl.float32), dtype, SOFT_BF16)
            if PROLOGUE == 3 or PROLOGUE == 4:
                a32 = a.to(tl.float32)
                if PROLOGUE == 3:
                    sq3 += tl.sum(a32 * a32, axis=1)
                nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = _round(nw[None, :] * a32, dtype, SOFT_BF16)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
        if F32_DOT:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if PROLOGUE == 3:
        acc = acc * tl.div_rn(1.0, tl.sqrt_rn(sq3 / K + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = _round(acc, dtype, SOFT_BF16)
    if ADD:  # out is the residual: residual += y, rounded as torch's add
        r = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        y = _round(y.to(tl.float32) + r, dtype, SOFT_BF16)
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: str,
           norm_weight: torch.Tensor | None, out: torch.Tensor | None, add: bool) -> None:
    if prologue not in PROLOGUES and prologue not in VARIANTS:
        raise ValueError(f"prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous (N, K) matrix, got shape {tuple(weight.shape)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"weight dtype must be one of {SUPPORTED_DTYPES}, got {weight.dtype}")
    n, k = weight.shape
    width = 2 * k if prologue == "silu_mul" else k
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"x must be (M, {width}), got shape {tuple(x.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; a skinny launch takes at most {MAX_ROWS}")
    if (x.dtype, x.device) != (weight.dtype, weight.device):
        raise ValueError(f"x is {x.dtype} on {x.device}, weight {weight.dtype} on {weight.device}")
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride in its last dim, got strides {x.stride()}")
    for name, vec, size in (("bias", bias, n), ("norm_weight", norm_weight, k)):
        if vec is not None and (vec.shape != (size,) or vec.dtype != weight.dtype or vec.device != weight.device
                                or vec.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous ({size},) {weight.dtype} vector on {weight.device}")
    if (prologue in ("norm", "norm_late", "scale")) != (norm_weight is not None):
        raise ValueError("norm_weight is needed by the norm prologue and only by it")
    if add and out is None:
        raise ValueError("add=True adds into out (the residual): out is needed")
    if out is not None:
        if out.dim() != 2 or out.shape != (x.shape[0], n) or out.dtype != weight.dtype or out.device != x.device:
            raise ValueError(f"out must be ({x.shape[0]}, {n}) {weight.dtype} on {x.device}, "
                             f"got {out.dtype} {tuple(out.shape)}")
        if out.shape[0] and out.stride(1) != 1:
            raise ValueError("out must have unit stride in its last dim")
        if add and x.shape[0] and out.data_ptr() == x.data_ptr():
            raise ValueError("out (the residual) must not be x")


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    out: torch.Tensor | None = None,
    add: bool = False,
    check: bool = True,
) -> torch.Tensor:
    """``prologue(x) @ weight.T + bias`` of ``x (M, K)`` (``(M, 2K)`` for silu_mul), ``M <= MAX_ROWS``.

    ``prologue``: "none"; "norm" (RMSNorm of x with ``norm_weight (K,)`` and
    ``eps``); "silu_mul" (``silu(gate) * up`` of ``x = [gate | up]``).
    ``add``: ``out`` is a residual ``(M, N)`` and receives ``out + product``
    (rounded) in place. Returns ``out`` (a new ``(M, N)`` tensor if None).
    """
    if check:
        _check(x, weight, bias, prologue, norm_weight, out, add)
    n, k = weight.shape
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=weight.dtype, device=weight.device)
    if m == 0 or n == 0:
        return out
    cfg = skinny_config(n, k)
    block_m = max(16, triton.next_power_of_2(m))
    block_k = cfg.block_k
    while block_k > 32 and cfg.num_stages * (block_m + cfg.block_n) * block_k * weight.element_size() > SMEM_BYTES:
        block_k //= 2   # more rows per block: shorter K trips keep the pipeline's stages in shared memory
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))
    _skinny_kernel[grid](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight, out,
        m, n, k, x.stride(0), out.stride(0), eps,
        PROLOGUE=PROLOGUES.get(prologue, VARIANTS.get(prologue, 0)), ADD=add, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        F32_DOT=_f32_dot(weight.dtype), SOFT_BF16=_soft_bf16(weight.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _f32_dot(dtype: torch.dtype) -> bool:
    """float32 weights: IEEE products (no TF32, as torch); bf16 under the interpreter, whose bf16 dot is wrong."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret))

"""Skinny linear layers for steps of a few tokens (CUDA), where they beat cuBLAS on the card.

A decode step of a few sequences multiplies a handful of rows by every
weight matrix: it is bound by reading the weights, and for small matrices
by each kernel's fixed latency. ``skinny_linear`` is one Triton kernel for
``out = x @ W.T (+ bias)`` with ``M <= MAX_ROWS`` rows: each program owns
``BLOCK_N`` output columns of a block of rows and streams its slice of W
once, ``BLOCK_K`` at a time, into one float32 accumulator (no split-K:
one summation order per config), rounded once after the bias.

It is used only where it was measured faster than cuBLAS
(``bench/gpu_kernels.py``, kept in ``worker/kernels/triton/tuned/<card>.json``): per
weight shape, a launch config and the most rows it wins at. On an H200
that is every layer of SmolLM2-135M's shape (2.8-4.1 us against cuBLAS's
3.2-5.0 us at 1-16 rows) and no layer of the 1B shape (parity within 3%).
A card without a tuned file uses cuBLAS everywhere.

Fusing the RMSNorm or SiLU·mul into the product's prologue was measured
and dropped: the norm's sum-of-squares pass and the in-loop SiLU serialise
loads the pipeline does not hide (1B gate_up 17.7 -> 28.3 us with the norm,
down 13.6 -> 193 us with SiLU; docs/benchmarks-gpu.md).

No wrapper reads a device value or allocates anything but its output, so
every call can be captured in a CUDA graph. Import this module after
setting ``TRITON_INTERPRET=1`` to run it on CPU tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from jitney.worker.config import MAX_SKINNY_ROWS
from jitney.worker.kernels.triton.fused import _round, _soft_bf16

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The most rows a skinny launch takes; above it every row block would re-read the weights.
MAX_ROWS = MAX_SKINNY_ROWS
SMEM_BYTES = 160 * 1024   # what a launch's pipeline stages may take (the limit bench/gpu_kernels.py measured under)


class SkinnyConfig(NamedTuple):
    """One weight shape's launch (columns per program, K per trip, warps, stages) and the most rows it wins at."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    max_rows: int = MAX_ROWS


# By (N, K): the shapes measured faster than cuBLAS on this card (``tuned_configs`` fills it).
CONFIGS: dict[tuple[int, int], SkinnyConfig] = {}


def skinny_config(n: int, k: int) -> SkinnyConfig:
    """The launch of an ``(M, K) @ (N, K).T`` product: the tuned one, else a generic guess."""
    if (n, k) in CONFIGS:
        return CONFIGS[(n, k)]
    return SkinnyConfig(16 if n <= 8192 else 64, min(256, max(32, triton.next_power_of_2(k))), 4, 4)


@triton.jit(do_not_specialize=["M"])   # one binary for every row count of a row block (no compile in a step)
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, x_stride, out_stride,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    # program (column block, row block)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)   # (BLOCK_M, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)   # (BLOCK_N, BLOCK_K)
        if F32_DOT:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, _round(acc, out_ptr.dtype.element_ty, SOFT_BF16), mask=row_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous (N, K) matrix, got shape {tuple(weight.shape)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"weight dtype must be one of {SUPPORTED_DTYPES}, got {weight.dtype}")
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got shape {tuple(x.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; a skinny launch takes at most {MAX_ROWS}")
    if (x.dtype, x.device) != (weight.dtype, weight.device):
        raise ValueError(f"x is {x.dtype} on {x.device}, weight {weight.dtype} on {weight.device}")
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride in its last dim, got strides {x.stride()}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype or bias.device != weight.device
                             or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous ({n},) {weight.dtype} vector on {weight.device}")
    if out is not None and (out.shape != (x.shape[0], n) or out.dtype != weight.dtype or out.device != x.device
                            or (out.shape[0] and out.stride(1) != 1)):
        raise ValueError(f"out must be ({x.shape[0]}, {n}) {weight.dtype} on {x.device} with unit stride in its "
                         f"last dim, got {out.dtype} {tuple(out.shape)}")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """``x @ weight.T + bias`` of ``x (M, K)``, ``M <= MAX_ROWS`` -> ``out`` (a new ``(M, N)`` if None)."""
    if check:
        _check(x, weight, bias, out)
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
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        F32_DOT=_f32_dot(weight.dtype), SOFT_BF16=_soft_bf16(weight.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _f32_dot(dtype: torch.dtype) -> bool:
    """float32 weights: IEEE products (no TF32, as torch); bf16 under the interpreter, whose bf16 dot is wrong."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret))


class SkinnyLinear(nn.Module):
    """A linear layer that runs ``skinny_linear`` for at most ``max_rows`` rows and ``F.linear`` above."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self.max_rows:
            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_skinny_linears(model: nn.Module, max_rows: int) -> list[tuple[int, int]]:
    """Swap each ``nn.Linear`` of ``model`` whose (N, K) is in ``CONFIGS`` for a ``SkinnyLinear``, up to
    ``min(max_rows, its shape's max_rows)`` rows -> the shapes swapped."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or tuple(module.weight.shape) not in CONFIGS:
            continue
        shape = (module.weight.shape[0], module.weight.shape[1])
        rows = min(max_rows, CONFIGS[shape].max_rows)
        if rows < 1:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                SkinnyLinear(module.weight.data, None if module.bias is None else module.bias.data, rows))
        swapped.append(shape)
    return swapped

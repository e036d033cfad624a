"""A batch-invariant Triton matmul for the model's linear layers on CUDA.

Why: cuBLAS picks its kernel (tile shape, split-K, stream-K) by heuristics
over the whole problem shape, M included, so the same token's row of
``x @ W.T`` can come out with different bits depending on how many other
tokens share the step. Sampling then depends on who else is being served.

The rule here: one output tile per program, and the tile config (BLOCK_M,
BLOCK_N, BLOCK_K, warps, stages) is chosen from N, K and the dtype only
(``tile_config``), never from M. There is no split-K: each program loops over
K in order, BLOCK_K at a time, into one float32 accumulator, and rounds once
(after the bias) to the activation dtype. A row's arithmetic is therefore
the same whether it comes alone, in a batch of 300, or at any position in
it; rows past M are masked. M is also kept out of Triton's specialisation
key (``do_not_specialize``), so M = 1 runs the very same binary as M = 300.

Cost: a fixed BLOCK_M of 64 wastes MMA work on decode steps of a few rows
(cheap: decode is bound by reading the weights), and without split-K a
narrow layer (small N, long K) launches few programs, so at small M it
reads its weight with a fraction of the SMs where cuBLAS would split K.
The configs are first guesses, not yet tuned on a GPU; changing one changes
the bits of that layer (not the invariance). float32 uses IEEE products
(no TF32), as torch does by default.

Import this module after setting ``TRITON_INTERPRET=1`` to run it on CPU
tensors: Triton decides between compiling and interpreting at decoration.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from jitney.worker.kernels.cpu.packed import replace_linears
from jitney.worker.kernels.triton.fused import _round, _soft_bf16

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TileConfig(NamedTuple):
    """One launch shape: tile sizes, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tile_config(n: int, k: int, dtype: torch.dtype) -> TileConfig:
    """The tiles of an ``(M, K) @ (N, K).T`` product: from N, K and dtype only, never M.

    BLOCK_M is 64 (one Hopper warpgroup MMA, and tl.dot's MMA path at any
    M: below 16 rows it would fall back to FMA). BLOCK_K is 64 for 16-bit
    inputs (128-byte rows) and 32 for float32, shrunk (power of two, at
    least 16) for a short K. BLOCK_N grows with N: a narrow layer gets
    narrow tiles so that more programs share its weight read.
    """
    wide = dtype == torch.float32
    block_k = min(32 if wide else 64, max(16, triton.next_power_of_2(max(k, 1))))
    block_n = 32 if n <= 1024 else 64 if n < 16384 else 128
    stages = 3 if wide or block_n == 128 else 4
    return TileConfig(block_m=64, block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    # One (BLOCK_M, BLOCK_N) tile of out per program: N tiles on axis 0, M tiles on axis 1.
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_tile = x_ptr + rows[:, None] * x_stride + ks[None, :]  # (BM, BK)
    w_tile = w_ptr + cols[None, :] * w_stride + ks[:, None]  # (BK, BN): W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # in order, one accumulator: the reduction order is fixed by K
        if EVEN_K:
            a = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_tile, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _round(acc, out_ptr.dtype.element_ty, SOFT_BF16)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def _f32_dot(dtype: torch.dtype) -> bool:
    """Whether the dot takes float32 operands with IEEE products (no TF32).

    float32 always (torch's default precision); bfloat16 only under the
    interpreter, whose bf16 ``tl.dot`` is wrong in Triton 3.9 (the products
    of bf16 values are exact in float32, so the sums are the same kind).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret))


def _check_matrix(name: str, tensor: torch.Tensor, shape: str) -> None:
    """2-d, a supported dtype, unit stride in the last dim."""
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-d {shape}, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be one of {SUPPORTED_DTYPES}, got {tensor.dtype}")
    if tensor.numel() > 0 and tensor.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {tensor.stride()}")


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    _check_matrix("x", x, "(M, K)")
    _check_matrix("weight", weight, "(N, K)")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be (N, {x.shape[1]}) for x (M, {x.shape[1]}), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be ({weight.shape[0]},), got shape {tuple(bias.shape)}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias is {bias.dtype} on {bias.device}, x {x.dtype} on {x.device}")
        if bias.numel() > 0 and bias.stride(0) != 1:
            raise ValueError("bias must be contiguous")
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"x is on {x.device}: the kernel needs CUDA tensors (or TRITON_INTERPRET=1)")


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           check: bool = True) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` of ``x (M, K)``, ``weight (N, K)`` -> ``(M, N)`` in x's dtype.

    ``weight`` in ``nn.Linear``'s layout; ``bias (N,)`` or None. float16,
    bfloat16 or float32, all the same dtype and device, unit stride in the
    last dim (any row stride). float32 accumulation, one rounding at the end;
    each row's bits depend on that row, N, K and the dtype only. Allocates
    only its output and reads no device value (CUDA-graph safe).
    """
    if check:
        _check_args(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = tile_config(n, k, x.dtype)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, F32_DOT=_f32_dot(x.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SOFT_BF16=_soft_bf16(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


class TritonInvariantLinear(nn.Module):
    """``nn.Linear``'s ``y = x W^T + b`` through ``matmul``; x is (..., in_features).

    Holds the original ``weight`` and ``bias`` parameters (no copy), so the
    state dict keeps its names.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return matmul(x, self.weight, self.bias)
        y = matmul(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_invariant_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``model`` by a ``TritonInvariantLinear``; return how many."""
    return replace_linears(model, lambda linear: TritonInvariantLinear(linear.weight, linear.bias))

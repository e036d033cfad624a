"""A mixture-of-experts layer's routed experts on CUDA: a Triton fused-MoE kernel.

``fused_experts`` computes, for each token t with routed experts e_s and router
weights w_s (s = 0 .. k-1, in top-k order),

    out[t] = sum_s w_s * down_{e_s}(act(gate_{e_s}(x_t), up_{e_s}(x_t)))

running only the routed experts, each expert's weights read once per tile of
its rows, not once per token:

1. Sort. The step's T * k (token, slot) pairs are sorted by expert (a stable
   sort: an expert's pairs in token order), and each expert's run is cut into
   blocks of BLOCK_M rows; ``block_expert[b]`` names the expert of block b
   (-1: a block past the last one used). All on the device, without reading a
   value back, so the launch is the same whatever the routing (CUDA graphs);
   the grid is the bound on the number of blocks, cdiv(T k, BLOCK_M) + min(E, T k).
2. gate_up. One program per (block, column tile of I): the block's rows of x,
   gathered by token, times the expert's gate and up rows (two accumulators over
   the same K loop), the bias added, each rounded to x's dtype, then
   ``act`` (silu(gate) * up, or gpt-oss's clamped form) rounded once, stored at
   the pair's row of an (T k, I) buffer.
3. down. One program per (block, column tile of H): the act rows times the
   expert's down, the bias added, times the pair's router weight, in float32,
   stored at the pair's row of a (T k, H) float32 buffer.
4. Sum. Each token's k rows added in top-k order into float32 from zero, then
   rounded once to x's dtype: the order ``layers/moe.py``'s torch loop and the
   CPU kernel (``kernels/cpu/moe.py``) use.

Batch invariance. The tiles (BLOCK_M 64, BLOCK_N and BLOCK_K from N, K and the
dtype: ``matmul.tile_config``) never depend on T or the routing, each program
sums over K in order into one accumulator, and a pair's row of the product
depends on that row only; so a token's bits do not depend on the other tokens
of the step, nor on where its pairs land in their experts' blocks.

Import this module after setting ``TRITON_INTERPRET=1`` to run it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jitney.worker.kernels.triton.fused import _round, _soft_bf16
from jitney.worker.kernels.triton.matmul import SUPPORTED_DTYPES, _f32_dot, tile_config

BLOCK_M = 64
ACTIVATIONS = {"silu": 0, "gpt_oss": 1}


@triton.jit
def _block_rows(b, order_ptr, block_expert_ptr, block_first_ptr, expert_start_ptr, expert_count_ptr,
                BLOCK_M: tl.constexpr):
    """Block b's expert (-1: none; the caller skips it), its pairs and which of its
    BLOCK_M rows hold one (for -1, expert 0's: in bounds, never used)."""
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    safe = tl.maximum(e, 0)
    local = (b - tl.load(block_first_ptr + safe)) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = local < tl.load(expert_count_ptr + safe)
    pair = tl.load(order_ptr + tl.load(expert_start_ptr + safe) + local, mask=ok, other=0).to(tl.int64)
    return e, safe, pair, ok


@triton.jit(do_not_specialize=["TOPK"])
def _gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, act_ptr, order_ptr, block_expert_ptr, block_first_ptr, expert_start_ptr,
    expert_count_ptr, TOPK, I, K, x_stride, w_expert_stride, act_stride, alpha, limit,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    b = tl.program_id(1)
    e, safe, pair, row_ok = _block_rows(b, order_ptr, block_expert_ptr, block_first_ptr, expert_start_ptr,
                                        expert_count_ptr, BLOCK_M)
    if e >= 0:
        token = pair // TOPK
        cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        ks = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + token[:, None] * x_stride + ks[None, :]
        g_tile = w_ptr + safe * w_expert_stride + cols[None, :] * K + ks[:, None]   # gate rows: W^T
        u_tile = g_tile + I * K                                                   # up rows follow
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
                wg = tl.load(g_tile, mask=col_ok[None, :], other=0.0)
                wu = tl.load(u_tile, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = ks < K - k
                a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                wu = tl.load(u_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if F32_DOT:
                a = a.to(tl.float32)
                acc_g = tl.dot(a, wg.to(tl.float32), acc_g, input_precision="ieee")
                acc_u = tl.dot(a, wu.to(tl.float32), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
            x_tile += BLOCK_K
            g_tile += BLOCK_K
            u_tile += BLOCK_K
        if HAS_BIAS:
            bias = bias_ptr + safe * 2 * I + cols
            acc_g += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias + I, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dtype = act_ptr.dtype.element_ty
        g = _round(acc_g, dtype, SOFT_BF16).to(tl.float32)
        u = _round(acc_u, dtype, SOFT_BF16).to(tl.float32)
        if ACT == 0:
            y = g / (1.0 + tl.exp(-g)) * u
        else:   # gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            y = (u + 1.0) * (g / (1.0 + tl.exp(-g * alpha)))
        tl.store(act_ptr + pair[:, None] * act_stride + cols[None, :], _round(y, dtype, SOFT_BF16),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["TOPK"])
def _down_kernel(
    act_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, order_ptr, block_expert_ptr, block_first_ptr,
    expert_start_ptr, expert_count_ptr, TOPK, N, K, act_stride, w_expert_stride, out_stride,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(1)
    e, safe, pair, row_ok = _block_rows(b, order_ptr, block_expert_ptr, block_first_ptr, expert_start_ptr,
                                        expert_count_ptr, BLOCK_M)
    if e >= 0:
        cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_tile = act_ptr + pair[:, None] * act_stride + ks[None, :]
        w_tile = w_ptr + safe * w_expert_stride + cols[None, :] * K + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_tile, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_tile, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = ks < K - k
                a = tl.load(a_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if F32_DOT:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            a_tile += BLOCK_K
            w_tile += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + safe * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + pair[:, None] * out_stride + cols[None, :], acc * weight[:, None],
                 mask=row_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
           activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be 2-d (T, H) of {SUPPORTED_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    t, h = x.shape
    if gate_up.dim() != 3 or gate_up.shape[1] % 2 or gate_up.shape[2] != h:
        raise ValueError(f"gate_up must be (E, 2I, {h}), got {tuple(gate_up.shape)}")
    e, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (e, h, inter):
        raise ValueError(f"down must be ({e}, {h}, {inter}), got {tuple(down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids and topk_weights must both be ({t}, k), got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (e, 2 * inter)), ("down_bias", down_bias, (e, h))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(bias.shape)}")
    for name, tensor in (("gate_up", gate_up), ("down", down), ("gate_up_bias", gate_up_bias),
                         ("down_bias", down_bias)):
        if tensor is not None and (tensor.dtype != x.dtype or tensor.device != x.device):
            raise ValueError(f"{name} is {tensor.dtype} on {tensor.device}, x {x.dtype} on {x.device}")
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"x is on {x.device}: the kernel needs CUDA tensors (or TRITON_INTERPRET=1)")


def _sorted_blocks(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """The pairs sorted by expert and the blocks of BLOCK_M rows over them (module docstring, 1).

    Returns ``order`` (pairs by expert), ``block_expert`` (-1 past the last used
    block), each expert's first block, first sorted row and pair count."""
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))     # bincount would read its max back
    starts = torch.cumsum(counts, 0) - counts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = torch.cumsum(blocks, 0)
    firsts = ends - blocks
    grid = triton.cdiv(pairs, BLOCK_M) + min(num_experts, pairs)
    index = torch.arange(grid, dtype=torch.int64, device=flat.device)
    expert = torch.searchsorted(ends, index, right=True)
    block_expert = torch.where(expert < num_experts, expert, torch.full_like(expert, -1))
    return order, block_expert, firsts, starts, counts


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, *, activation: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0, out_float: bool = False, check: bool = True) -> torch.Tensor:
    """The routed experts' weighted sum for each token (module docstring): ``(T, H)``.

    ``x (T, H)``; ``gate_up (E, 2I, H)`` (gate rows, then up), ``down (E, H, I)``
    in x's dtype and device; ``topk_ids (T, k)`` expert ids, ``topk_weights (T, k)``
    their weights (any float dtype; used in float32). ``out_float``: the float32
    sums, unrounded (for an all-reduce of partial sums)."""
    if check:
        _check(x, gate_up, down, topk_ids, topk_weights, gate_up_bias, down_bias, activation)
    t, h = x.shape
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    k = topk_ids.shape[1]
    out_dtype = torch.float32 if out_float else x.dtype
    if t == 0 or k == 0:
        return torch.zeros(t, h, dtype=out_dtype, device=x.device)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    order, block_expert, firsts, starts, counts = _sorted_blocks(topk_ids, num_experts)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    blocks = (order, block_expert, firsts, starts, counts)
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    up_cfg = tile_config(inter, h, x.dtype)
    _gate_up_kernel[(triton.cdiv(inter, up_cfg.block_n), block_expert.numel())](
        x, gate_up, gate_up_bias if gate_up_bias is not None else gate_up, act, *blocks,
        k, inter, h, x.stride(0), gate_up.stride(0), act.stride(0), alpha, limit,
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], EVEN_K=h % up_cfg.block_k == 0,
        F32_DOT=_f32_dot(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=up_cfg.block_n, BLOCK_K=up_cfg.block_k,
        SOFT_BF16=_soft_bf16(x.dtype), num_warps=up_cfg.num_warps, num_stages=up_cfg.num_stages,
    )
    partial = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    down_cfg = tile_config(h, inter, x.dtype)
    _down_kernel[(triton.cdiv(h, down_cfg.block_n), block_expert.numel())](
        act, down, down_bias if down_bias is not None else down, weights, partial, *blocks,
        k, h, inter, act.stride(0), down.stride(0), partial.stride(0),
        HAS_BIAS=down_bias is not None, EVEN_K=inter % down_cfg.block_k == 0, F32_DOT=_f32_dot(x.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=down_cfg.block_n, BLOCK_K=down_cfg.block_k,
        num_warps=down_cfg.num_warps, num_stages=down_cfg.num_stages,
    )
    rows = partial.view(t, k, h)
    out = rows[:, 0].clone()
    for slot in range(1, k):    # top-k order, one float32 add at a time
        out += rows[:, slot]
    return out if out_float else out.to(x.dtype)

"""Multi-LoRA on CUDA: every row's adapter delta by segmented Triton kernels (rows grouped by slot).

In ``layers/lora.py``'s layout (A ``(S, R, in)``, B ``(S, out, R)`` in the model's dtype, each
adapter zero-padded to R; scale ``(S,)`` float32; slot 0 the base model), a row t of slot s gains

    delta[t] = B[s] @ (scale[s] * (A[s] @ x[t]))        float32, (out,)

in four steps, none of which reads a device value back (so the launches are the same
whatever the slots, and a CUDA graph can hold them):

1. Blocks (``lora_blocks``; once per step, shared by every layer and target). Rows sorted
   by slot (stable: a slot's rows in row order), each adapter's run cut into blocks of
   BLOCK_M rows; slot 0 gets no block, so base rows cost nothing and their delta is exactly
   zero. ``block_slot[b]`` names block b's slot, -1 past the last used block; the grid is
   the bound cdiv(T, BLOCK_M) + min(S - 1, T). The same tables as ``moe.py``'s experts.
2. Shrink. One program per (block, chunk of ``in``, tile of R): the block's rows of x
   times the chunk of A[s]^T, summed over the chunk in order into float32, stored as that
   chunk's partial product (SPLITS, T, R). The chunks (``K_CHUNK`` wide) let a decode
   step's few rows read A[s] with many SMs, not one.
3. Sum. Each row's partials added in chunk order, times its scale: (T, R) float32.
4. Expand. One program per (block, tile of ``out``): the block's shrunk rows times
   B[s]^T over R in float32 (IEEE products), then either stored (``lora_delta_triton``:
   (T, out) float32, base rows 0) or added to y's column slice and rounded once to y's
   dtype (``lora_add_triton``: what ``LoraSlots.apply`` does with the torch delta).

Batch invariance: the tiles and chunks follow in, out, R and the dtype only, never T or
the slots, and every sum runs in a fixed order, so a row's bits do not depend on the other
rows of the step nor on where it lands in its adapter's blocks. Against ``lora_delta``
(the torch reference) only the summation order differs: float32 results agree to rounding.

Slot values must lie in [0, S): that is the caller's invariant (the runner assigns them),
not checked here, since checking would read the slots back to the host.

Import this module after setting ``TRITON_INTERPRET=1`` to run it on CPU tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from jitney.worker.kernels.triton.fused import _round, _soft_bf16
from jitney.worker.kernels.triton.matmul import SUPPORTED_DTYPES, _f32_dot
from jitney.worker.kernels.triton.moe import _block_rows

BLOCK_M = 32        # rows per block: decode steps put few rows on an adapter
K_CHUNK = 256       # the widest chunk of ``in`` one shrink program sums
BLOCK_N = 64        # expand's columns per program
SUM_ROWS = 16       # rows per program of the partials' sum
MAX_RANK = 256      # --max-lora-rank's bound (worker/config.py)
SLOT_DTYPES = (torch.int32, torch.int64)


class LoraBlocks(NamedTuple):
    """A step's rows grouped by slot (module docstring, 1): all (int64) on the slots' device."""

    slots: torch.Tensor        # (T,) each row's slot
    order: torch.Tensor        # (T,) rows sorted by slot
    block_slot: torch.Tensor   # (grid,) the slot of each block; -1: unused
    first_block: torch.Tensor  # (S,) each slot's first block
    slot_start: torch.Tensor   # (S,) each slot's first position in ``order``
    slot_count: torch.Tensor   # (S,) each slot's rows

    @property
    def num_slots(self) -> int:
        return self.slot_count.numel()


class ShrinkConfig(NamedTuple):
    block_k: int
    k_chunk: int
    block_r: int
    splits: int


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(
    x_ptr, a_ptr, part_ptr, order_ptr, block_slot_ptr, first_block_ptr, slot_start_ptr, slot_count_ptr,
    T, R, K, x_stride, a_slot_stride, RANK_TILES: tl.constexpr, K_CHUNK: tl.constexpr, EVEN_K: tl.constexpr,
    F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(1)
    s, safe, row, row_ok = _block_rows(b, order_ptr, block_slot_ptr, first_block_ptr, slot_start_ptr,
                                       slot_count_ptr, BLOCK_M)
    if s >= 0:
        split = tl.program_id(0) // RANK_TILES
        ranks = (tl.program_id(0) % RANK_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = ranks < R
        k0 = split.to(tl.int64) * K_CHUNK
        ks = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + row[:, None] * x_stride + k0 + ks[None, :]                  # (BM, BK)
        a_tile = a_ptr + safe * a_slot_stride + ranks[None, :] * K + k0 + ks[:, None]  # (BK, BR): A[s]^T
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, K_CHUNK, BLOCK_K):   # in order, one accumulator
            if EVEN_K:
                xs = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
                w = tl.load(a_tile, mask=r_ok[None, :], other=0.0)
            else:
                k_ok = ks < K - k0 - k
                xs = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(a_tile, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if F32_DOT:
                acc = tl.dot(xs.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, w, acc)
            x_tile += BLOCK_K
            a_tile += BLOCK_K
        dst = part_ptr + split.to(tl.int64) * T * R + row[:, None] * R + ranks[None, :]
        tl.store(dst, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _sum_kernel(part_ptr, scale_ptr, slots_ptr, shrunk_ptr, T, R, SPLITS: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ranks = tl.arange(0, BLOCK_R)
    in_t = rows < T
    slot = tl.load(slots_ptr + rows, mask=in_t, other=0).to(tl.int64)
    ok = in_t & (slot > 0)                 # base rows' partials were never written
    mask = ok[:, None] & (ranks < R)[None, :]
    src = part_ptr + rows[:, None] * R + ranks[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for j in range(SPLITS):                # chunk order
        acc += tl.load(src + j * T * R, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + slot, mask=ok, other=0.0)
    tl.store(shrunk_ptr + rows[:, None] * R + ranks[None, :], acc * scale[:, None],
             mask=in_t[:, None] & (ranks < R)[None, :])


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(
    shrunk_ptr, b_ptr, out_ptr, order_ptr, block_slot_ptr, first_block_ptr, slot_start_ptr, slot_count_ptr,
    T, N, R, b_slot_stride, out_stride, ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    b = tl.program_id(1)
    s, safe, row, row_ok = _block_rows(b, order_ptr, block_slot_ptr, first_block_ptr, slot_start_ptr,
                                       slot_count_ptr, BLOCK_M)
    if s >= 0:
        cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        rs = tl.arange(0, BLOCK_R)
        h_tile = shrunk_ptr + row[:, None] * R + rs[None, :]                        # (BM, BR)
        b_tile = b_ptr + safe * b_slot_stride + cols[None, :] * R + rs[:, None]      # (BR, BN): B[s]^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r in range(0, R, BLOCK_R):
            r_ok = rs < R - r
            h = tl.load(h_tile, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
            w = tl.load(b_tile, mask=r_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(h, w, acc, input_precision="ieee")
            h_tile += BLOCK_R
            b_tile += BLOCK_R
        dst = out_ptr + row[:, None] * out_stride + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if ADD:   # y's value plus the delta in float32, rounded once
            y = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst, _round(y + acc, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)
        else:
            tl.store(dst, acc, mask=mask)


def rank_block(rank: int) -> int:
    """R's tile: a power of two from 16 (``tl.dot``'s least) to 64."""
    return min(64, max(16, triton.next_power_of_2(rank)))


def shrink_config(in_features: int, rank: int, dtype: torch.dtype) -> ShrinkConfig:
    """Shrink's tiles and chunks: from ``in``, R and the dtype only (batch invariance)."""
    block_k = min(32 if dtype == torch.float32 else 64, max(16, triton.next_power_of_2(in_features)))
    k_chunk = min(K_CHUNK, triton.cdiv(in_features, block_k) * block_k)
    return ShrinkConfig(block_k, k_chunk, rank_block(rank), triton.cdiv(in_features, k_chunk))


def lora_blocks(slots: torch.Tensor, num_slots: int) -> LoraBlocks:
    """The step's rows grouped by slot (module docstring, 1), for ``num_slots`` slots
    (``max_loras + 1``); ``slots`` (T,) int32 or int64 on the kernels' device."""
    if slots.dim() != 1 or slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"slots must be 1-d (T,) of {SLOT_DTYPES}, got {tuple(slots.shape)} {slots.dtype}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be at least 1 (slot 0, the base model), got {num_slots}")
    rows = slots.numel()
    flat = slots.to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_slots, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))     # bincount would read its max back
    starts = torch.cumsum(counts, 0) - counts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    blocks[0] = 0                                         # the base model's rows: no block
    ends = torch.cumsum(blocks, 0)
    grid = triton.cdiv(rows, BLOCK_M) + min(num_slots - 1, rows)
    slot = torch.searchsorted(ends, torch.arange(grid, dtype=torch.int64, device=flat.device), right=True)
    block_slot = torch.where(slot < num_slots, slot, torch.full_like(slot, -1))
    return LoraBlocks(flat, order, block_slot, ends - blocks, starts, counts)


def _check(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
           blocks: LoraBlocks | None) -> None:
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be 2-d (T, in) of {SUPPORTED_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    t, k = x.shape
    if a.dim() != 3 or a.shape[2] != k or not 1 <= a.shape[1] <= MAX_RANK:
        raise ValueError(f"a must be (S, R, {k}) with R in 1..{MAX_RANK}, got {tuple(a.shape)}")
    s, r = a.shape[0], a.shape[1]
    if b.dim() != 3 or b.shape[0] != s or b.shape[2] != r:
        raise ValueError(f"b must be ({s}, out, {r}), got {tuple(b.shape)}")
    if tuple(scale.shape) != (s,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be ({s},) float32, got {tuple(scale.shape)} {scale.dtype}")
    if tuple(slots.shape) != (t,) or slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"slots must be ({t},) of {SLOT_DTYPES}, got {tuple(slots.shape)} {slots.dtype}")
    for name, tensor in (("a", a), ("b", b)):
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} is {tensor.dtype}, x {x.dtype}: the slots hold the model's dtype")
    for name, tensor in (("a", a), ("b", b), ("scale", scale), ("slots", slots)):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
    if blocks is not None and (blocks.num_slots != s or blocks.slots.shape != slots.shape):
        raise ValueError(f"blocks were made for {blocks.num_slots} slots and {blocks.slots.numel()} rows, "
                         f"not {s} and {t}")
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"x is on {x.device}: the kernels need CUDA tensors (or TRITON_INTERPRET=1)")


def _shrunk(x: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, blocks: LoraBlocks) -> torch.Tensor:
    """Steps 2 and 3: ``scale[s] * A[s] @ x[t]`` (T, R) float32 (base rows 0)."""
    t, k = x.shape
    r = a.shape[1]
    cfg = shrink_config(k, r, x.dtype)
    rank_tiles = triton.cdiv(r, cfg.block_r)
    table = blocks[1:]
    part = torch.empty(cfg.splits, t, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(cfg.splits * rank_tiles, blocks.block_slot.numel())](
        x, a, part, *table, t, r, k, x.stride(0), a.stride(0), RANK_TILES=rank_tiles, K_CHUNK=cfg.k_chunk,
        EVEN_K=k % cfg.k_chunk == 0, F32_DOT=_f32_dot(x.dtype), BLOCK_M=BLOCK_M, BLOCK_R=cfg.block_r,
        BLOCK_K=cfg.block_k, num_warps=4,
    )
    shrunk = torch.empty(t, r, dtype=torch.float32, device=x.device)
    _sum_kernel[(triton.cdiv(t, SUM_ROWS),)](part, scale, blocks.slots, shrunk, t, r, SPLITS=cfg.splits,
                                            BLOCK_T=SUM_ROWS, BLOCK_R=triton.next_power_of_2(r), num_warps=4)
    return shrunk


def _expand(shrunk: torch.Tensor, b: torch.Tensor, out: torch.Tensor, blocks: LoraBlocks, add: bool) -> None:
    """Step 4: ``B[s] @ shrunk[t]`` into ``out`` (stored, or added and rounded to out's dtype)."""
    t, r = shrunk.shape
    n = b.shape[1]
    _expand_kernel[(triton.cdiv(n, BLOCK_N), blocks.block_slot.numel())](
        shrunk, b, out, *blocks[1:], t, n, r, b.stride(0), out.stride(0), ADD=add, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_R=rank_block(r), SOFT_BF16=_soft_bf16(out.dtype), num_warps=4,
    )


def lora_delta_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                      slots: torch.Tensor, blocks: LoraBlocks | None = None, *, check: bool = True) -> torch.Tensor:
    """``scale[s] * B[s] @ (A[s] @ x[t])`` for each row t of slot s = ``slots[t]``: (T, out)
    float32, base rows (slot 0) exactly 0; ``layers/lora.py``'s ``lora_delta`` contract.

    ``x (T, in)``; ``a (S, R, in)``, ``b (S, out, R)`` in x's dtype; ``scale (S,)`` float32;
    ``slots (T,)`` int32/int64 in [0, S), all on x's device. ``blocks``: ``lora_blocks(slots, S)``
    when the caller made them already (once per step serves every linear)."""
    if check:
        _check(x, a, b, scale, slots, blocks)
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0] == 0 or a.shape[0] == 1:
        return out
    blocks = lora_blocks(slots, a.shape[0]) if blocks is None else blocks
    x, a, b, scale = x.contiguous(), a.contiguous(), b.contiguous(), scale.contiguous()
    _expand(_shrunk(x, a, scale, blocks), b, out, blocks, add=False)
    return out


def lora_add_triton(y: torch.Tensor, offset: int, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scale: torch.Tensor, slots: torch.Tensor, blocks: LoraBlocks | None = None, *,
                    check: bool = True) -> torch.Tensor:
    """``y[:, offset:offset + out]`` plus each row's delta (``lora_delta_triton``), added in
    float32 and rounded once to y's dtype, in place; returns ``y``. Base rows are left as they were."""
    if check:
        _check(x, a, b, scale, slots, blocks)
        n = b.shape[1]
        if y.dim() != 2 or y.shape[0] != x.shape[0] or y.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"y must be 2-d ({x.shape[0]}, N) of {SUPPORTED_DTYPES}, got {tuple(y.shape)} {y.dtype}")
        if not 0 <= offset <= y.shape[1] - n:
            raise ValueError(f"columns [{offset}, {offset + n}) are not within y's {y.shape[1]}")
        if y.device != x.device or (y.numel() > 0 and y.stride(1) != 1):
            raise ValueError(f"y must be on {x.device} with unit column stride, got {y.device}, strides {y.stride()}")
    if x.shape[0] == 0 or a.shape[0] == 1:
        return y
    blocks = lora_blocks(slots, a.shape[0]) if blocks is None else blocks
    x, a, b, scale = x.contiguous(), a.contiguous(), b.contiguous(), scale.contiguous()
    _expand(_shrunk(x, a, scale, blocks), b, y.narrow(1, offset, b.shape[1]), blocks, add=True)
    return y

"""Triton paged attention for a fused step, and the backend that uses it.

One kernel serves prefill chunks and decodes alike. A program owns one
(sequence, kv head, tile of query tokens); the ``G = nh // kvh`` query heads
that share the kv head are folded into the tile's rows, so K/V are read once
per group:

    # row r of a tile -> query token  tile * BLOCK_Q + r // GP
    #                    query head   kv_head * G + r % GP   (rows with r % GP >= G: padding)
    # query token i of sequence s sits at position seq_len - q_len + i and
    # sees keys [0, that position] ([that position - window + 1, it] with a window)

It walks the sequence's keys ``BLOCK_N`` at a time through its block table
(each key's slot is looked up, so any block size works), with an online
softmax in float32. Only the key tiles some query of the tile can see are
read, and with a window no key (nor block-table entry) below the tile's first
query's window: those blocks may be freed. Optionally the scores are
soft-capped and each query head's sink logit starts the softmax's running
maximum and sum. No host value enters the kernel but the grid, so a decode
step can be captured in a CUDA graph.

Import after setting ``TRITON_INTERPRET=1`` to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jitney.worker.attention.backend import AttentionBackend, AttentionMetadata
from jitney.worker.attention.features import check_features
from jitney.worker.kernels.triton.cache import check_cache_pair, check_index, check_tokens, write_kv_cache

LOG2_E = 1.4426950408889634
_LOG2_E = tl.constexpr(LOG2_E)  # the kernels' copy (a jitted function reads constexpr globals only)
# Rows (query tokens x padded group) per tile; tl.dot needs at least 16.
PREFILL_ROWS = 64
DECODE_ROWS = 16
BLOCK_N = 64  # keys per inner iteration (64 halves the loop trips of 32 at the same tile registers)
# Warps and pipeline stages of a launch: (decode-only, prefill or tile-mapped); None = Triton's default.
LAUNCH: dict[str, tuple[int | None, int | None]] = {"decode": (None, None), "prefill": (None, None)}


@triton.jit
def _tanh(x):
    """tanh: the odd Taylor series to x^9 below |x| = 1/4 (where the exponential form
    loses digits), else (1 - e^-2|x|) / (1 + e^-2|x|) with x's sign."""
    a = tl.abs(x)
    x2 = x * x
    small = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0))))
    e = tl.exp2(a * (-2.0 * _LOG2_E))
    big = (1.0 - e) / (1.0 + e)
    return tl.where(a >= 0.25, tl.where(x < 0, -big, big), small)


@triton.jit
def _attend_keys(q, k_cache_ptr, v_cache_ptr, table, start, kv_begin, kv_end, q_pos, m_i, l_i, acc,
                 dims, dim_ok, scale_log2, block_size, kv_head, window, softcap_log2,
                 cache_stride_block, cache_stride_slot, cache_stride_head,
                 BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, MASKED: tl.constexpr,
                 WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One trip of the online softmax over keys [start, start + BLOCK_N); ``MASKED`` False:
    every key is in [kv_begin, kv_end) and visible to every query row (the same arithmetic,
    no mask). Keys below ``kv_begin`` (``WINDOW``) are not loaded. ``SOFTCAP``: ``scale_log2``
    is scale / softcap and the scores become softcap tanh(s) in log2 units."""
    k_pos = start + tl.arange(0, BLOCK_N)
    k_ok = k_pos < kv_end
    if WINDOW:
        k_ok = k_ok & (k_pos >= kv_begin)
    block = tl.load(table + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
    slot = block * cache_stride_block + (k_pos % block_size) * cache_stride_slot + kv_head * cache_stride_head
    kv_mask = k_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, HEAD_P)
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = _tanh(s * scale_log2) * softcap_log2
    else:
        s = s * scale_log2
    if MASKED:
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))  # (M, BLOCK_N), log2 units
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no visible key yet keeps m = -inf: shift by 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, HEAD_P)
    if F32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, tile_seq_ptr, tile_idx_ptr, sinks_ptr,
    scale_log2, softcap_log2,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    table_stride, block_size, window,
    G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, FLAT: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if FLAT:  # program (flat tile, kv head): the tile's sequence and index come from the tile map
        flat = tl.program_id(0)
        seq = tl.load(tile_seq_ptr + flat).to(tl.int64)
        tile = tl.load(tile_idx_ptr + flat).to(tl.int32)
        if seq < 0:
            return
    else:     # program (sequence, kv head, tile)
        seq = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_pos = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GP)
    tok = tile * BLOCK_Q + rows // GP  # query index within the sequence
    head = kv_head * G + rows % GP
    row_ok = (tok < q_len) & (rows % GP < G)
    dims = tl.arange(0, HEAD_P)
    dim_ok = dims < HEAD_DIM
    q_off = (q_start + tok)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (M, HEAD_P)
    q_pos = first_pos + tok

    if SINKS:  # the sink is the softmax's first term: e^(sink - sink) = 1 (none at -inf)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * _LOG2_E
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_Q * GP], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GP], tl.float32)
    acc = tl.zeros([BLOCK_Q * GP, HEAD_P], tl.float32)
    # Keys past the tile's last query position are never visible; those up to its first
    # query's position (and, with a window, from its last query's window on) are visible
    # to every row: whole BLOCK_N trips of them skip the mask. Trips start at multiples of
    # BLOCK_N whatever the tile, so a row's trips are a decode's, plus trips it sees nothing of.
    kv_end = tl.minimum(seq_len, first_pos + (tile + 1) * BLOCK_Q)
    full_end = ((first_pos + tile * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N
    if WINDOW:
        kv_begin = tl.maximum(first_pos + tile * BLOCK_Q - window + 1, 0)
        walk_begin = (kv_begin // BLOCK_N) * BLOCK_N
        full_begin = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, full_end)
    else:
        kv_begin = 0
        walk_begin = 0
        full_begin = 0
    table = block_tables_ptr + seq * table_stride
    for start in range(walk_begin, full_begin, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, table, start, kv_begin, kv_end, q_pos, m_i, l_i,
                                     acc, dims, dim_ok, scale_log2, block_size, kv_head, window, softcap_log2,
                                     cache_stride_block, cache_stride_slot, cache_stride_head,
                                     BLOCK_N, F32_DOT, True, WINDOW, SOFTCAP)
    for start in range(full_begin, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, table, start, kv_begin, kv_end, q_pos, m_i, l_i,
                                     acc, dims, dim_ok, scale_log2, block_size, kv_head, window, softcap_log2,
                                     cache_stride_block, cache_stride_slot, cache_stride_head,
                                     BLOCK_N, F32_DOT, False, WINDOW, SOFTCAP)
    for start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, table, start, kv_begin, kv_end, q_pos, m_i, l_i,
                                     acc, dims, dim_ok, scale_log2, block_size, kv_head, window, softcap_log2,
                                     cache_stride_block, cache_stride_slot, cache_stride_head,
                                     BLOCK_N, F32_DOT, True, WINDOW, SOFTCAP)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (q_start + tok)[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :]
    tl.store(o_ptr + o_off, acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    check_cache_pair(k_cache, v_cache)
    kvh, head_dim = k_cache.shape[2:]
    if query.dim() != 3:
        raise ValueError(f"query must be (T, n_heads, head_dim), got shape {tuple(query.shape)}")
    if query.shape[1] % kvh != 0:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of kv heads ({kvh})")
    check_tokens("query", query, query.shape[1], head_dim, k_cache)
    check_index("query_start_loc", query_start_loc, 1, k_cache.device)
    check_index("seq_lens", seq_lens, 1, k_cache.device)
    check_index("block_tables", block_tables, 2, k_cache.device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have {num_seqs + 1} entries (num_seqs + 1), got {query_start_loc.shape[0]}")
    if block_tables.shape[0] < num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    check: bool = True,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
    decode_rows: int = DECODE_ROWS,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a ragged batch -> ``(T, nh, d)``.

    query (T, nh, d); k_cache, v_cache (num_blocks, block_size, kvh, d);
    query_start_loc (B + 1,), seq_lens (B,), block_tables (B, max_blocks).
    ``max_query_len`` (a host int, at least the longest query run) sizes
    the grid. ``tiles`` (a tile map: ``tile_seq``, ``tile_idx``, both
    ``(num_tiles,)`` int, from ``input_batch.tile_map``) instead launches one program per
    listed tile of ``prefill_block_q`` query tokens (``tile_seq`` -1: none),
    so the grid depends on no host value of the step: a mixed step can be
    captured in a CUDA graph. Indices are not range-checked (the runner validates plans).
    ``decode_rows``: query rows of a decode-only launch's tile; ``PREFILL_ROWS``
    gives decodes the prefill's tile height, so both run the same ``tl.dot``
    shapes (``--batch-invariant``).
    ``window``, ``softcap``, ``sinks`` (nh,) float32: ``backend``'s optional
    features (None: off); a sequence's block-table entries below its first
    query's window are not read. Checked whatever ``check`` (layers differ in them).
    Raises ``ValueError`` on a shape, dtype, device or layout it cannot take.
    """
    check_features(query.shape[1], query.device, window, softcap, sinks)
    if check:  # the model checks its first layer's call of a step; the others have the same shapes
        _check_attention_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError("out must match query's shape and dtype, with unit stride in head_dim")
    num_seqs, (block_size, kvh, head_dim) = seq_lens.shape[0], k_cache.shape[1:]
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    group = query.shape[1] // kvh
    gp = triton.next_power_of_2(group)
    if tiles is not None:
        block_q = prefill_block_q(query.shape[1], kvh)
        grid: tuple[int, ...] = (tiles[0].shape[0], kvh)
        tile_seq, tile_idx = tiles
    else:
        block_q = max(gp, decode_rows if max_query_len == 1 else PREFILL_ROWS) // gp
        grid = (num_seqs, kvh, triton.cdiv(max_query_len, block_q))
        tile_seq = tile_idx = seq_lens  # not read
    # With a soft cap the kernel takes tanh(s * scale / softcap) * softcap, in log2 units.
    scale_arg, softcap_log2 = (scale * LOG2_E, 0.0) if softcap is None else (scale / softcap, softcap * LOG2_E)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, tile_seq, tile_idx,
        seq_lens if sinks is None else sinks,  # not read without sinks
        scale_arg, softcap_log2,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), block_size, 0 if window is None else window,
        G=group, GP=gp, HEAD_DIM=head_dim, HEAD_P=triton.next_power_of_2(head_dim),
        BLOCK_Q=block_q, BLOCK_N=BLOCK_N, F32_DOT=_f32_dot(query.dtype), FLAT=tiles is not None,
        WINDOW=window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        **_launch_options("decode" if tiles is None and max_query_len == 1 else "prefill"),
    )
    return out


def _launch_options(kind: str) -> dict[str, int]:
    warps, stages = LAUNCH[kind]
    return {k: v for k, v in (("num_warps", warps), ("num_stages", stages)) if v is not None}


def prefill_block_q(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per tile of a prefill (or tile-mapped) launch."""
    gp = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(gp, PREFILL_ROWS) // gp


class TritonPagedAttention(AttentionBackend):
    """The CUDA path: both calls are single Triton launches per layer.

    Reads only ``num_seqs``/``num_decodes`` and the query lengths on the host
    (for the grid); with every sequence decoding, nothing host-side depends
    on the values, so the step can be replayed from a CUDA graph.
    """

    graph_safe = True

    def __init__(self, *, batch_invariant: bool = False) -> None:
        # Keys are walked BLOCK_N at a time from position 0 and never split
        # between programs, for every launch; batch invariance also gives a
        # decode the prefill's tile height, so its dot products have the
        # same shapes (the cost: idle rows in a memory-bound launch).
        self.decode_rows = PREFILL_ROWS if batch_invariant else DECODE_ROWS

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale, max_query_len(meta), check=self.checking, tiles=meta.tiles, decode_rows=self.decode_rows,
            window=window, softcap=softcap, sinks=sinks,
        )


def _f32_dot(dtype: torch.dtype) -> bool:
    """Whether the kernel's matmuls run in exact float32.

    float32 inputs: so the results match the torch path (no TF32).
    bfloat16 under the interpreter: Triton 3.9's interpreter computes bf16
    ``tl.dot`` wrongly, so it gets float32 operands there (compiled kernels
    use the native bf16 dot).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and triton.knobs.runtime.interpret)


def max_query_len(meta: AttentionMetadata) -> int:
    """Longest query run of the step, from host values only."""
    if meta.tiles is not None or meta.num_decodes == meta.num_seqs:
        return 1  # a tile-mapped launch does not read it
    starts = meta.query_start_loc_host
    return max(b - a for a, b in zip(starts, starts[1:]))

"""Paged attention: the metadata of a fused step and the backends that use it.

The KV cache of one layer is two tensors of ``num_blocks`` blocks, each
laid out as the backend reads it (``AttentionBackend.block_shapes``):
token-major ``(num_blocks, block_size, n_kv_heads, head_dim)`` here, the CPU
kernel's own layout for ``InvariantCpuAttention``. Token ``p`` of a sequence
lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

A fused step flattens the new tokens of all its sequences into one ``(T,)``
batch, grouped by sequence, decodes first:

    # [0, num_decodes)          -> decodes: one query token each
    # [num_decodes, B)          -> prefill chunks: any number of query tokens
    # for sequence i: tokens [query_start_loc[i], query_start_loc[i+1]) are its
    # queries, at positions [seq_lens[i] - query_len_i, seq_lens[i])

Every backend's ``attend`` takes three optional features of a layer (None: off):

    # window   a query at position p sees keys [p - window + 1, p] (transformers'
    #          sliding_window); a sequence's blocks wholly before its first
    #          query's window are not read, nor their block-table entries
    # softcap  scores s = scale q.k become softcap * tanh(s / softcap) (Gemma 2)
    # sinks    (nh,) float32, a logit per query head in the softmax's denominator
    #          with no value (gpt-oss): out = sum_j e^(s_j - m) v_j / (e^(sink - m)
    #          + sum_j e^(s_j - m))
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from jitney.worker.kernels.cpu import ops as cpu_kernels
from jitney.worker.attention.features import capped_softmax_attention, check_features, first_window_block
from jitney.worker.attention.kv_cache import BlockShapes, CacheGeometry, token_major


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each one attends to.

    Passed explicitly to every layer; there is no global context.

    Attributes:
      slot_mapping: (T,) int64, cache slot of each new token.
      query_start_loc: (B + 1,) int64, cumulative query counts per sequence.
      seq_lens: (B,) int64, context length of each sequence including its
        new tokens.
      block_tables: (B, max_blocks) int64, each sequence's blocks, padded
        with 0 (padding is masked out, never read as context).
      num_decodes: sequences [0, num_decodes) have exactly one query token.
      query_start_loc_host, seq_lens_host: the same values as Python ints,
        so the prefill path slices without device syncs.
      block_size: tokens per cache block.
      decode_groups: the CPU backend's plan: the decodes split into
        contiguous runs attended one call each, so a short sequence is not
        padded to the batch's longest (see ``plan_decode_groups``); set by
        ``TorchPagedAttention.prepare`` once per step, used by every layer.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    block_size: int
    decode_groups: tuple[DecodeGroup, ...] = ()
    prepared: bool = False  # the backend's ``prepare`` ran (it runs once per step)
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # a tile map (graph-captured mixed steps)
    # (T,) int32, each token's LoRA slot (layers/lora.py); None when no token of the step has one
    lora_slots: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @classmethod
    def build(
        cls,
        *,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Build from per-sequence host lists (tests and the memory profile;
        the runner stages its steps through ``InputBatch`` instead).

        The leading sequences with one query token are the batched decodes;
        put all of them first (a later one-token chunk still works, through
        the per-sequence path).

        ``block_tables[i]`` must cover positions ``[0, seq_lens[i])``.
        """
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        starts = [0]
        for qlen in query_lens:
            starts.append(starts[-1] + qlen)
        used = [t[: math.ceil(s / block_size)] for t, s in zip(block_tables, seq_lens)]
        width = max(map(len, used), default=0)
        padded = [t + [0] * (width - len(t)) for t in used]
        slots = _slot_mapping(query_lens, seq_lens, used, block_size)

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            slot_mapping=tensor(slots),
            query_start_loc=tensor(starts),
            seq_lens=tensor(seq_lens),
            block_tables=tensor(padded).view(len(seq_lens), width),
            num_decodes=num_decodes,
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(seq_lens),
            block_size=block_size,
        )


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes ``[start, end)`` attended in one call, padded to ``max_len``.

    tables: (n, ceil(max_len / block_size)) block ids; mask: (n, 1, 1,
    max_len) bool, True where a key is inside the sequence (it broadcasts
    over every query head).
    """

    start: int
    end: int
    max_len: int
    tables: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(cls, start: int, end: int, seq_lens: list[int], tables: torch.Tensor,
              lens: torch.Tensor, block_size: int) -> DecodeGroup:
        max_len = max(seq_lens[start:end])
        positions = torch.arange(max_len, device=lens.device)
        mask = positions[None, :] < lens[start:end, None]  # (n, max_len)
        return cls(start, end, max_len, tables[start:end, : math.ceil(max_len / block_size)],
                   mask[:, None, None, :])


# Cost of one more attention call per layer, in padded key slots (measured on
# a 2-core CPU: a call costs about as much as ~500 slots of gather + attention).
GROUP_COST_SLOTS = 512


def plan_decode_groups(seq_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split decodes into contiguous runs minimising padded slots + calls.

    Exact dynamic programme over the given order (the runner sorts decodes
    by length, which makes contiguous runs the right shape); n <= max seats.
    Neighbours with the same padded length are never split (moving one to
    the group with the smaller maximum never costs more), so the programme
    runs over runs of equal lengths: far fewer than n in practice.
    """
    if not seq_lens:
        return []
    runs: list[list[int]] = []   # [padded length, count]
    for s in seq_lens:
        padded = math.ceil(s / block_size) * block_size
        if runs and runs[-1][0] == padded:
            runs[-1][1] += 1
        else:
            runs.append([padded, 1])
    r = len(runs)
    best = [0.0] + [math.inf] * r     # best[j]: cost of runs [0, j)
    cut = [0] * (r + 1)
    for j in range(1, r + 1):
        longest, count = 0, 0
        for i in range(j - 1, -1, -1):   # last group is runs [i, j)
            longest = max(longest, runs[i][0])
            count += runs[i][1]
            cost = best[i] + count * longest + GROUP_COST_SLOTS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    starts = [0]
    for _, n in runs:
        starts.append(starts[-1] + n)
    groups = []
    j = r
    while j > 0:
        groups.append((starts[cut[j]], starts[j]))
        j = cut[j]
    return groups[::-1]


def _slot_mapping(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[int]:
    """Cache slot of every new token, sequence after sequence."""
    slots: list[int] = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(slen - qlen, slen):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


class AttentionBackend(ABC):
    """How K/V reach the paged cache and how queries attend over it.

    A CUDA backend (Triton kernels) implements the same calls.
    """

    graph_safe: bool = False
    """True when ``write_kv``/``attend`` read no host value of the metadata
    but the grid (``num_seqs``, ``num_decodes``, query lengths), so a
    decode step can be captured in a CUDA graph and replayed with new
    device values. The model also runs its fused Triton layer ops then."""

    checking: bool = True
    """Whether calls check their arguments: the model sets it for the first
    layer of a step only (the other layers pass the same shapes)."""

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Per-step planning, once before the first layer (default: none)."""
        return meta

    def block_shapes(self, geometry: CacheGeometry) -> BlockShapes:
        """How this backend lays out one block of K and of V (default: token-major,
        ``(block_size, kvh, head_dim)``, the layout ``write_kv`` and ``attend`` use here)."""
        return token_major(geometry)

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store the step's K/V ``(T, kvh, d)`` at ``meta.slot_mapping``."""

    @abstractmethod
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
        """Causal attention of ``query (T, nh, d)`` over the cache -> ``(T, nh, d)``.

        Called after ``write_kv``, so each token sees its own K/V. ``window``,
        ``softcap``, ``sinks``: the module docstring's features (None: off); a
        backend raises ``ValueError`` for one it cannot honour.
        """


def gqa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention without copying K/V per query head.

    query (B, Tq, nh, d); key, value (B, L, kvh, d); mask (B, Tq, L) bool,
    True = may attend; sinks (nh,). Returns (B, Tq, nh, d).

    The g = nh // kvh query heads that share a kv head are folded into the
    query-length axis, so one plain SDPA call serves them all.
    """
    b, tq, nh, d = query.shape
    kvh = key.shape[2]
    g = nh // kvh
    q = query.view(b, tq, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, tq * g, d)
    k = key.transpose(1, 2)  # (B, kvh, L, d)
    v = value.transpose(1, 2)
    m = mask.repeat_interleave(g, dim=1).unsqueeze(1)  # (B, 1, Tq*g, L)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)  # (B, kvh, Tq*g, d)
    else:  # row t * g + r of kv head h is query head h * g + r
        sink_rows = None if sinks is None else sinks.view(kvh, g).repeat(1, tq)
        out = capped_softmax_attention(q, k, v, m, scale, softcap, sink_rows)
    return out.view(b, kvh, tq, g, d).permute(0, 2, 1, 3, 4).reshape(b, tq, nh, d)


def _decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor, scale: float, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: query (n, nh, d), key/value (n, L, kvh, d),
    mask (n, 1, 1, L) -> (n, nh, d). The g query heads of a kv head are its rows."""
    n, nh, d = query.shape
    kvh = key.shape[2]
    q = query.view(n, kvh, nh // kvh, d)                       # (n, kvh, g, d)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=mask, scale=scale)  # (n, kvh, g, d)
    else:
        sink_rows = None if sinks is None else sinks.view(kvh, nh // kvh)
        out = capped_softmax_attention(q, key.transpose(1, 2), value.transpose(1, 2), mask, scale, softcap, sink_rows)
    return out.reshape(n, nh, d)


def _windowed_group(group: DecodeGroup, meta: AttentionMetadata, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group's blocks from each sequence's first window block on, and their mask.

    Returns tables (n, width) (columns past a sequence's last block: 0, masked)
    and mask (n, 1, 1, width * block_size), True where a key is in the window.
    """
    bs, device = meta.block_size, meta.block_tables.device
    lens = meta.seq_lens_host[group.start:group.end]
    firsts = [first_window_block(s, 1, window, bs) for s in lens]
    width = max(-(-s // bs) - f for s, f in zip(lens, firsts))
    cols = torch.tensor(firsts, device=device)[:, None] + torch.arange(width, device=device)  # (n, width)
    rows = meta.block_tables[group.start:group.end]
    used = torch.tensor([-(-s // bs) for s in lens], device=device)
    tables = torch.where(cols < used[:, None], rows.gather(1, cols.clamp(max=rows.shape[1] - 1)), 0)
    positions = cols[:, :1] * bs + torch.arange(width * bs, device=device)  # (n, width * bs)
    seq_lens = torch.tensor(lens, device=device)[:, None]
    mask = (positions < seq_lens) & (positions >= seq_lens - window)
    return tables, mask[:, None, None, :]


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache (num_blocks, bs, kvh, d), tables (B, n) -> (B, n * bs, kvh, d).

    index_select is about 3x faster than advanced indexing on CPU.
    """
    b, n = tables.shape
    bs, kvh, d = cache.shape[1:]
    return cache.index_select(0, tables.reshape(-1)).view(b, n * bs, kvh, d)


@dataclass(frozen=True)
class _Features:
    """An ``attend`` call's window, soft cap and sinks (None: off)."""

    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None


class TorchPagedAttention(AttentionBackend):
    """The CPU (and fallback) path in plain torch.

    Decodes are batched: per run of similar context length
    (``meta.decode_groups``) their blocks are gathered into one padded
    ``(n, max_len, kvh, d)`` tensor and attended in one call. Prefill chunks
    are attended one sequence at a time. With a window only the window's
    blocks are gathered; a soft cap or sinks leave SDPA for the same
    arithmetic written out in float32 (``features.capped_softmax_attention``).
    """

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Plan the decodes' runs (``meta.decode_groups``) from host lengths."""
        if meta.prepared:
            return meta
        n = meta.num_decodes
        groups = tuple(
            DecodeGroup.build(start, end, list(meta.seq_lens_host), meta.block_tables, meta.seq_lens, meta.block_size)
            for start, end in plan_decode_groups(list(meta.seq_lens_host[:n]), meta.block_size))
        return replace(meta, decode_groups=groups, prepared=True)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        kvh, d = k_cache.shape[2:]
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, value)

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
        check_features(query.shape[1], query.device, window, softcap, sinks)
        features = _Features(window, softcap, sinks)
        out = torch.empty_like(query)
        n = meta.num_decodes
        if n > 0:
            out[:n] = self._decodes(query[:n], k_cache, v_cache, meta, scale, features)
        for i in range(n, meta.num_seqs):
            start, end = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
            out[start:end] = self._prefill(query[start:end], i, k_cache, v_cache, meta, scale, features)
        return out

    def _decodes(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        features: _Features,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        for group in meta.decode_groups:
            q = query[group.start:group.end]
            if features.window is None:
                key = _gather_blocks(k_cache, group.tables)[:, :group.max_len]  # (n, L, kvh, d)
                value = _gather_blocks(v_cache, group.tables)[:, :group.max_len]
                mask = group.mask
            else:  # the window's blocks only (the sequence's earlier ones may be freed)
                tables, mask = _windowed_group(group, meta, features.window)
                key, value = _gather_blocks(k_cache, tables), _gather_blocks(v_cache, tables)
            out[group.start:group.end] = _decode_attention(q, key, value, mask, scale, features.softcap,
                                                           features.sinks)
        return out  # (B, nh, d)

    def _prefill(
        self,
        query: torch.Tensor,
        index: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        features: _Features,
    ) -> torch.Tensor:
        seq_len = meta.seq_lens_host[index]
        num_queries = query.shape[0]
        # Keys from the first block of the first query's window (block 0 without a window).
        first = first_window_block(seq_len, num_queries, features.window, meta.block_size)
        table = meta.block_tables[index, first : math.ceil(seq_len / meta.block_size)]
        key = _gather_blocks(k_cache, table[None])[0, :seq_len - first * meta.block_size]  # (L, kvh, d)
        value = _gather_blocks(v_cache, table[None])[0, :seq_len - first * meta.block_size]
        # Query i sits at position seq_len - num_queries + i: it sees keys up
        # to and including that position (earlier chunks included), and in its window.
        q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        k_pos = torch.arange(first * meta.block_size, seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # (Tq, L)
        if features.window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - features.window
        out = gqa_attention(query[None], key[None], value[None], mask[None], scale, features.softcap, features.sinks)
        return out[0]  # (Tq, nh, d)


def kernel_pack(dtype: torch.dtype) -> int:
    """P of the CPU kernel's K layout: the elements of one 32-bit lane (2 for bfloat16, 1 for float32)."""
    return max(1, 4 // dtype.itemsize)


def kernel_block_shapes(geometry: CacheGeometry) -> BlockShapes:
    """The CPU kernel's layout (``csrc/kv_layout.h``): K ``(kvh, d / P, block_size, P)``,
    V ``(kvh, block_size / P, d, P)``, P = 4 bytes / element size (2 for bfloat16, 1 for float32).

    Each kv head of a block is one contiguous run in both. K holds its keys in
    the 32-bit lanes the scores are computed in, V pairs of keys in the lanes
    the weighted sum of values reads (the tile unit's B operand as it lies):
    neither is transposed when read.
    """
    bs, kvh, d = geometry.block_size, geometry.num_kv_heads, geometry.head_dim
    pack = kernel_pack(geometry.dtype)
    if d % pack:
        raise ValueError(f"head_dim {d} is not a multiple of {pack} (the CPU kernel's K layout)")
    if bs % pack:
        raise ValueError(f"block size {bs} is not a multiple of {pack} (the CPU kernel's {geometry.dtype} V layout)")
    return (kvh, d // pack, bs, pack), (kvh, bs // pack, d, pack)


def to_kernel_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major caches ``(num_blocks, block_size, kvh, d)`` copied into the CPU kernel's layout."""
    n, bs, kvh, d = k_cache.shape
    pack = kernel_pack(k_cache.dtype)
    k = k_cache.reshape(n, bs, kvh, d // pack, pack).permute(0, 2, 3, 1, 4).contiguous()
    v = v_cache.reshape(n, bs // pack, pack, kvh, d).permute(0, 3, 1, 4, 2).contiguous()
    return k, v


def from_kernel_layout(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's caches back to token-major ``(num_blocks, block_size, kvh, d)``."""
    n, kvh, per_pair, bs, pack = k.shape
    return (k.permute(0, 3, 1, 2, 4).reshape(n, bs, kvh, per_pair * pack).contiguous(),
            v.permute(0, 2, 4, 1, 3).reshape(n, bs, kvh, per_pair * pack).contiguous())


class InvariantCpuAttention(AttentionBackend):
    """The CPU's default path: ``cpu_kernels.paged_attention``.

    Each query token reads its own sequence's K/V blocks in place, from
    position 0 (or its window's first block) to its own, in one fixed order
    (see ``csrc/attention.cpp``): no gather, no padding, and the same bits for
    a token whatever else is in the step, however its prompt was chunked, and
    whether it is a decode or a recomputed prefill token. Its cache has the
    kernel's own layout (``kernel_block_shapes``), written by ``write_kv`` here
    or by the CPU layer ops' fused ``rope_and_cache``.
    """

    def block_shapes(self, geometry: CacheGeometry) -> BlockShapes:
        return kernel_block_shapes(geometry)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        _, kvh, per_pair, bs, pack = k_cache.shape
        slots = meta.slot_mapping
        stored = slots >= 0   # a negative slot is a padding token: nothing to store (as rope_and_cache)
        if not bool(stored.all()):
            slots, key, value = slots[stored], key[stored], value[stored]
        blocks, offsets = slots // bs, slots % bs
        k_cache[blocks, :, :, offsets] = key.reshape(-1, kvh, per_pair, pack)
        v_cache[blocks, :, offsets // pack, :, offsets % pack] = value

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Cut the block tables to the step's widest context, as int64, once per step."""
        if meta.prepared:
            return meta
        width = max((-(-s // meta.block_size) for s in meta.seq_lens_host), default=0)
        tables = meta.block_tables[:, :width].to(torch.int64).contiguous()
        return replace(meta, block_tables=tables, prepared=True)

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
        check_features(query.shape[1], query.device, window, softcap, sinks)
        return cpu_kernels.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                           meta.query_start_loc, scale, window=window, softcap=softcap, sinks=sinks)

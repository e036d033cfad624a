"""Paged attention problems for the feature tests (sliding window, soft cap, sinks).

A ``PagedCase`` keeps each sequence's keys and values dense beside the paged
caches, so the reference never reads the caches: a test may poison the
blocks before a window (``poison_early_blocks``) and still compare with it.
The reference's mask is transformers' own mask function, evaluated at the
queries' and keys' absolute positions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from jitney.worker.attention.backend import AttentionBackend, AttentionMetadata, InvariantCpuAttention, to_kernel_layout
from jitney.worker.attention.features import first_window_block

CPU = torch.device("cpu")
CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()


def register_forms() -> list[str]:
    """The forms that run the scalar loops' arithmetic in vector registers, which this CPU
    has (each is built only where the compiler targets its instructions, -march=native):
    avx512 (16 lanes) and avx2 (8 lanes, with FMA)."""
    return ["avx512"] * ("avx512f" in CPU_FLAGS) + ["avx2"] * ({"avx2", "fma"} <= CPU_FLAGS)


def named_forms() -> list[str]:
    """The CPU attention kernel's forms with bits of their own (not the scalar loops') that
    this CPU runs (bfloat16 only): the dot-product form (what ``auto`` runs for bfloat16
    where the CPU has AVX-512 BF16) and the tile-unit form (named only)."""
    return (["avx512bf16"] * ("avx512_bf16" in CPU_FLAGS)
            + ["amx"] * ({"amx_bf16", "avx512_bf16"} <= CPU_FLAGS))


def auto_bf16_form() -> str:
    """The form ``auto`` runs bfloat16 in on this CPU: the dot products' where it has
    AVX-512 BF16, else the widest registers' that run the scalar loops' arithmetic, else
    the scalar loops."""
    if "avx512_bf16" in CPU_FLAGS:
        return "avx512bf16"
    return (register_forms() or ["portable"])[0]


def dtype_forms() -> list[tuple[torch.dtype, str]]:
    """(dtype, form) pairs to run a test of the invariant CPU backend in: both dtypes in
    the default form, and bfloat16 in every other form this CPU has (the register forms,
    whose bits are the scalar loops', where auto runs another)."""
    others = [f for f in register_forms() + named_forms() if f != auto_bf16_form()]
    return [(torch.float32, "auto"), (torch.bfloat16, "auto")] + [(torch.bfloat16, f) for f in others]


@contextlib.contextmanager
def attention_form(form: str) -> Iterator[None]:
    """The process's CPU attention form (what ``auto`` runs) set to ``form`` for a block."""
    from jitney.worker.kernels.cpu import ops as cpu_kernels
    cpu_kernels.set_attention_kernel(form)
    try:
        yield
    finally:
        cpu_kernels.set_attention_kernel("auto")


@dataclass(frozen=True)
class PagedCase:
    """query (T, nh, d); token-major caches (num_blocks, block_size, kvh, d);
    keys[i], values[i] (seq_lens[i], kvh, d): sequence i's context, dense."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tables: list[list[int]]
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int

    def meta(self, device: torch.device = CPU) -> AttentionMetadata:
        return AttentionMetadata.build(query_lens=self.query_lens, seq_lens=self.seq_lens, block_tables=self.tables,
                                       block_size=self.block_size, device=device)

    def to(self, device: torch.device) -> PagedCase:
        return replace(self, query=self.query.to(device), k_cache=self.k_cache.to(device),
                       v_cache=self.v_cache.to(device))


def paged_case(dtype: torch.dtype, heads: tuple[int, int, int], block: int, seq_lens: list[int],
               query_lens: list[int], *, seed: int = 0, fill: float = float("nan")) -> PagedCase:
    """Random K/V in scattered blocks (block 0 is never a sequence's: it is the tables'
    padding), ``fill`` in every slot no sequence owns; sequences with one query first."""
    nh, kvh, d = heads
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(s / block) for s in seq_lens]
    num_blocks = sum(needed) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    k_cache = torch.full((num_blocks, block, kvh, d), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    tables, keys, values = [], [], []
    for s, need in zip(seq_lens, needed):
        table, order = order[:need], order[need:]
        key = torch.randn(s, kvh, d, generator=gen).to(dtype)
        value = torch.randn(s, kvh, d, generator=gen).to(dtype)
        for pos in range(s):
            k_cache[table[pos // block], pos % block] = key[pos]
            v_cache[table[pos // block], pos % block] = value[pos]
        tables.append(table)
        keys.append(key)
        values.append(value)
    query = torch.randn(sum(query_lens), nh, d, generator=gen).to(dtype)
    return PagedCase(query, k_cache, v_cache, keys, values, tables, list(query_lens), list(seq_lens), block)


def poison_early_blocks(case: PagedCase, window: int, *, block_id: int | None = None) -> PagedCase:
    """The case with every block-table entry wholly before its sequence's first query's
    window replaced: by a new block of NaNs (``block_id`` None), else by ``block_id``
    (say one past the cache). Returns the new case; the dense K/V are unchanged."""
    k_cache, v_cache = case.k_cache, case.v_cache
    if block_id is None:
        block_id = k_cache.shape[0]
        nan = torch.full_like(k_cache[:1], float("nan"))
        k_cache, v_cache = torch.cat([k_cache, nan]), torch.cat([v_cache, nan])
    tables = []
    for table, s, q in zip(case.tables, case.seq_lens, case.query_lens):
        first = first_window_block(s, q, window, case.block_size)
        tables.append([block_id] * first + table[first:])
    return replace(case, k_cache=k_cache, v_cache=v_cache, tables=tables)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(Tq, L) bool: transformers' (sliding window) causal mask at these absolute positions."""
    # Imported here: masking_utils imports Triton, which must see TRITON_INTERPRET first.
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    fn: Callable[..., Any] = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    zero = torch.zeros((), dtype=torch.long)
    mask: torch.Tensor = fn(zero, zero, q_pos[:, None], k_pos[None, :])   # its index arguments broadcast
    return mask


def reference_attention(case: PagedCase, scale: float, *, window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense float32 attention per sequence -> (T, nh, d): scores s = scale q.k, then
    softcap tanh(s / softcap), the mask, and the sink as one more logit with no value."""
    nh = case.query.shape[1]
    out, start = [], 0
    for qlen, slen, key, value in zip(case.query_lens, case.seq_lens, case.keys, case.values):
        g = nh // key.shape[1]
        k = key.float().repeat_interleave(g, dim=1)  # (L, nh, d)
        v = value.float().repeat_interleave(g, dim=1)
        q = case.query[start:start + qlen].cpu().float()  # (Tq, nh, d)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        mask = visible(torch.arange(slen - qlen, slen), torch.arange(slen), window)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            column = sinks.cpu().float()[:, None, None].expand(nh, qlen, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += qlen
    return torch.cat(out)


def random_sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Sink logits around the scores' own size (some far above it: most weight on the sink)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 2.0).float()


def attend_case(backend: AttentionBackend, case: PagedCase, scale: float, **features: Any) -> torch.Tensor:
    """``backend.attend`` over the case (its caches copied into the CPU kernel's layout for
    ``InvariantCpuAttention``), on the query's device."""
    k, v = case.k_cache, case.v_cache
    if isinstance(backend, InvariantCpuAttention):
        k, v = to_kernel_layout(k, v)
    meta = backend.prepare(case.meta(case.query.device))
    return backend.attend(case.query, k, v, meta, scale, **features)

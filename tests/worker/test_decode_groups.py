"""Batched decode attention in runs of similar length (worker/attention/backend.py)."""

from __future__ import annotations

import torch

from jitney.worker.attention.backend import GROUP_COST_SLOTS, AttentionMetadata, TorchPagedAttention, plan_decode_groups


def test_equal_lengths_stay_one_group() -> None:
    assert plan_decode_groups([100] * 40, 16) == [(0, 40)]


def test_a_few_long_contexts_get_their_own_run() -> None:
    lens = [40] * 30 + [600] * 2
    # One call: 32 * 608 slots; two: 30 * 48 + 2 * 608 + one more call.
    assert 32 * 608 > 30 * 48 + 2 * 608 + GROUP_COST_SLOTS
    assert plan_decode_groups(lens, 16) == [(0, 30), (30, 32)]


def test_small_batches_are_not_split_for_little_gain() -> None:
    assert plan_decode_groups([16, 32], 16) == [(0, 2)]
    assert plan_decode_groups([], 16) == []


def test_groups_cover_every_decode_once() -> None:
    lens = sorted([17, 900, 33, 250, 251, 16, 1024, 5, 64, 700])
    groups = plan_decode_groups(lens, 16)
    assert [i for a, b in groups for i in range(a, b)] == list(range(len(lens)))


def test_grouped_decodes_equal_one_padded_call() -> None:
    """Each decode attends over exactly its own context, however grouped."""
    torch.manual_seed(0)
    block_size, kvh, nh, d = 4, 2, 6, 8
    lens = [3, 5, 6, 40, 41]
    tables, next_block = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(list(range(next_block, next_block + need))[::-1])   # non-contiguous order
        next_block += need
    k_cache = torch.randn(next_block, block_size, kvh, d)
    v_cache = torch.randn(next_block, block_size, kvh, d)
    query = torch.randn(len(lens), nh, d)
    meta = AttentionMetadata.build(query_lens=[1] * len(lens), seq_lens=lens, block_tables=tables,
                                   block_size=block_size, device=torch.device("cpu"))
    backend = TorchPagedAttention()
    assert meta.decode_groups == ()        # grouping is the CPU backend's business
    meta = backend.prepare(meta)
    assert len(meta.decode_groups) >= 1
    out = backend.attend(query, k_cache, v_cache, meta, scale=d ** -0.5)
    for i, n in enumerate(lens):
        slots = [tables[i][p // block_size] * block_size + p % block_size for p in range(n)]
        k = k_cache.view(-1, kvh, d)[slots].repeat_interleave(nh // kvh, dim=1)   # (n, nh, d)
        v = v_cache.view(-1, kvh, d)[slots].repeat_interleave(nh // kvh, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[i], k) * d ** -0.5, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("hn,nhd->hd", weights, v), atol=1e-5, rtol=1e-5)

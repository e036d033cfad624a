"""Sliding-window KV memory in the scheduler: blocks wholly before every
layer's window go back to the pool as a request grows, and the prefix cache
still hits on a windowed model.

The block manager's counts are asserted exactly; the scheduler is driven
through the fake worker with the same window, which reads only the window
through the block table and drops its hold on the entries before it, so a
block released while still read (and handed to another request) changes
the output tokens or fails the fake worker's write check.
"""

from __future__ import annotations

import pytest

from jitney.scheduler.core.block_manager import BlockManager
from jitney.scheduler.core.config import SchedulerConfig, blocks_per_sequence, max_model_len_for
from jitney.scheduler.core.request import Request
from jitney.scheduler.core.scheduler import Scheduler
from tests.support.fake_worker import (FakeWorker, drive_step, make_request, reference_output, run_pipelined,
                                       run_until_idle)

WINDOW, BLOCK = 8, 4     # a query reads its last 8 keys: 2 or 3 blocks


def grow(bm: BlockManager, request: Request, n: int) -> list[int]:
    """Compute ``n`` more tokens of ``request`` as the scheduler does: release
    what its next query will not read, then allocate."""
    bm.release_before_window(request)
    new = bm.allocate_for(request, n)
    request.num_computed_tokens += n
    bm.cache_full_blocks(request, request.num_computed_tokens - n)
    return new


def test_blocks_before_the_window_are_released_as_a_request_grows() -> None:
    bm = BlockManager(11, BLOCK, window=WINDOW)       # 10 in the pool, block 10 the null one
    assert (bm.num_blocks, bm.null_block, bm.num_free_blocks) == (10, 10, 10)
    r = make_request(1, 40)
    assert grow(bm, r, 12) == [0, 1, 2]               # positions 0..11
    assert (bm.num_used_blocks, bm.num_cached_blocks) == (3, 3)
    # the next query (position 12) reads keys 5..12: blocks 1..3; block 0 goes back
    assert grow(bm, r, 1) == [3]
    assert r.block_ids == [10, 1, 2, 3]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 7)
    assert bm.ref_count(0) == 0 and bm.is_cached(0)    # idle, still in the prefix cache
    for _ in range(3):                                # positions 13..15: still block 3, window from block 1 or 2
        grow(bm, r, 1)
    assert r.block_ids == [10, 10, 2, 3] and bm.num_used_blocks == 2
    grow(bm, r, 8)                                    # positions 16..23 in one chunk: the window of 16 starts at 9
    assert r.block_ids == [10, 10, 2, 3, 4, 5] and bm.num_used_blocks == 4
    grow(bm, r, 1)                                    # position 24: keys 17..24, blocks 4..6
    assert r.block_ids == [10] * 4 + [4, 5, 6] and bm.num_used_blocks == 3
    bm.check_invariants()
    bm.free(r)
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (0, 10, 6)
    bm.check_invariants()


def test_no_window_keeps_every_block_and_the_whole_pool() -> None:
    bm = BlockManager(10, BLOCK)
    r = make_request(1, 40)
    for n in (12, 1, 8, 8):
        grow(bm, r, n)
    assert r.block_ids == list(range(8)) and bm.num_used_blocks == 8 and bm.null_block == -1


def test_a_windowed_hit_attaches_only_the_window_and_counts_refs() -> None:
    bm = BlockManager(21, BLOCK, window=WINDOW)
    a = make_request(1, list(range(1, 31)))            # 30 tokens: 7 full blocks
    for n in (12, 12, 6):
        grow(bm, a, n)
    assert a.block_ids == [20] * 4 + [4, 5, 6, 7]   # the window of 24 starts at 17: blocks 0..3 released
    b = make_request(2, list(range(1, 31)) + [99, 98])  # a hit of at most 31 tokens: 7 blocks
    hit = bm.find_cached_prefix(b)
    # its first query (position 28) reads keys 21..28: blocks 5 and 6 only
    assert hit == [20] * 5 + [5, 6]
    assert bm.can_board(hit, 32)
    bm.attach_cached(b, hit)
    assert (bm.ref_count(5), bm.ref_count(6), bm.ref_count(4)) == (2, 2, 1)
    assert bm.prefix_cache_hit_tokens == 28
    b.num_computed_tokens = 28
    grow(bm, b, 4)
    bm.free(a)
    assert (bm.ref_count(5), bm.ref_count(6), bm.ref_count(4)) == (1, 1, 0)
    bm.check_invariants()
    bm.free(b)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_a_hit_needs_only_the_window_when_older_blocks_were_evicted() -> None:
    bm = BlockManager(9, BLOCK, window=WINDOW)          # 8 in the pool
    a = make_request(1, list(range(1, 33)))
    for n in (8, 8, 8, 8):
        grow(bm, a, n)                                  # 32 tokens, 8 blocks keyed; 0..3 released on the way
    bm.free(a)
    filler = make_request(2, [500 + i for i in range(12)])
    grow(bm, filler, 12)                              # 3 fresh blocks evict the oldest idle: 0, 1, 2
    assert filler.block_ids == [0, 1, 2]               # the oldest released first: blocks 0..2 evicted
    b = make_request(3, list(range(1, 33)) + [7])
    hit = bm.find_cached_prefix(b)                     # 8 blocks; position 32 reads 25..32: blocks 6, 7
    assert hit == [8] * 6 + [6, 7]
    # without windows the tail is released first, so the same eviction costs the last 3 blocks of the hit
    plain = BlockManager(8, BLOCK)
    a2 = make_request(1, list(range(1, 33)))
    grow(plain, a2, 32)
    plain.free(a2)
    grow(plain, make_request(2, [500 + i for i in range(12)]), 12)
    assert plain.find_cached_prefix(make_request(3, list(range(1, 33)) + [7])) == [0, 1, 2, 3, 4]


def make(num_blocks: int, *, window: int = WINDOW, cache: bool = True, budget: int = 16,
         max_model_len: int = 512, seats: int = 8) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(block_size=BLOCK, num_blocks=num_blocks, max_model_len=max_model_len,
                             max_num_seqs=seats, max_num_batched_tokens=budget,
                             enable_prefix_caching=cache, sliding_window=window)
    return Scheduler(config), FakeWorker.for_config(config)


def test_a_long_windowed_request_holds_a_bounded_number_of_blocks() -> None:
    """300 prompt tokens and 60 more in chunks of 16: 90 blocks without a window, 6 with
    (the bound, blocks_per_sequence, is 7)."""
    peaks = {}
    for window in (0, WINDOW):
        s, w = make(200, window=window)
        r = make_request(1, [(5 * i) % 97 + 1 for i in range(300)], max_tokens=60, ignore_eos=True)
        s.add_request(r)
        peak = 0
        while s.has_work():
            drive_step(s, w)
            peak = max(peak, s.block_manager.num_used_blocks)
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 60, window)
        peaks[window] = peak
    assert peaks == {0: 90, WINDOW: 6}
    assert blocks_per_sequence(360, BLOCK, WINDOW, 16) == 7


def test_the_window_lets_a_small_cache_serve_a_long_context() -> None:
    assert max_model_len_for(4096, 12, BLOCK, WINDOW, 16) == 4096   # 11 blocks hold any one sequence
    assert max_model_len_for(4096, 12, BLOCK) == 48
    SchedulerConfig(block_size=BLOCK, num_blocks=8, max_model_len=4096, max_num_seqs=4,
                    max_num_batched_tokens=16, sliding_window=WINDOW)
    with pytest.raises(ValueError, match="KV cache holds"):
        SchedulerConfig(block_size=BLOCK, num_blocks=7, max_model_len=4096, max_num_seqs=4,
                        max_num_batched_tokens=16, sliding_window=WINDOW)


def test_a_prefix_hit_on_a_windowed_model_gives_the_same_tokens() -> None:
    prefix = [(3 * i) % 89 + 2 for i in range(50)]
    outputs = {}
    for cache in (True, False):
        s, w = make(40, cache=cache)
        first = make_request(1, prefix + [1], max_tokens=5, ignore_eos=True)
        s.add_request(first)
        run_until_idle(s, w)
        second = make_request(2, prefix + [2, 3], max_tokens=5, ignore_eos=True)
        s.add_request(second)
        out = drive_step(s, w)[0]
        start = out.scheduled[0].start_position
        assert start == (48 if cache else 0)
        if cache:
            # the table sent: nulls, then the two blocks the query at 48 reads (41..48)
            assert out.scheduled[0].new_block_ids[:12] == [39] * 10 + second.block_ids[10:12]
        run_until_idle(s, w)
        outputs[cache] = (first.output_token_ids, second.output_token_ids)
        assert second.output_token_ids == reference_output(second.prompt_token_ids, 5, WINDOW)
        assert s.block_manager.num_used_blocks == 0
        s.block_manager.check_invariants()
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("num_blocks", [14, 60])   # 14: preemptions
@pytest.mark.parametrize("window", [3, WINDOW, 13])
def test_concurrent_shared_prefixes_pipelined_match_the_reference(num_blocks: int, window: int) -> None:
    system = [(7 * i) % 97 + 3 for i in range(37)]
    results = {}
    for cache in (True, False):
        s, w = make(num_blocks, window=window, cache=cache, seats=4)
        requests = [make_request(i + 1, system + [200 + i] * (1 + i % 3), max_tokens=3 + i % 7, ignore_eos=True)
                    for i in range(10)]
        for r in requests[:3]:
            s.add_request(r)
        for _ in range(3):
            drive_step(s, w)
        for r in requests[3:]:
            s.add_request(r)
        run_pipelined(s, w)
        for r in requests:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens, window)
        assert s.block_manager.num_used_blocks == 0 and w.holders == {}
        s.block_manager.check_invariants()
        results[cache] = [r.output_token_ids for r in requests]
        if cache:
            assert s.block_manager.prefix_cache_hit_tokens > 0
    assert results[True] == results[False]


def test_n_samples_share_the_window_or_fall_back_to_the_cache() -> None:
    s, w = make(60)
    prompt = [(11 * i) % 83 + 1 for i in range(30)]
    parent = make_request(1, prompt, max_tokens=12, ignore_eos=True)
    children = []
    for i in (1, 2):
        child = make_request(1 + i, prompt, max_tokens=4, ignore_eos=True, arrival_time=parent.arrival_time)
        child.parent, child.sample_index = parent, i
        children.append(child)
    for r in (parent, *children):
        s.add_request(r)
    run_until_idle(s, w)
    for r in (parent, *children):
        assert r.output_token_ids == reference_output(prompt, r.sampling.max_tokens, WINDOW)
    assert all(c.num_cached_tokens == 28 for c in children)
    assert s.block_manager.num_used_blocks == 0

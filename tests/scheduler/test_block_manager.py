"""BlockManager: exact block ids, ref counts, free queue order, prefix cache."""

from __future__ import annotations

import pytest

from jitney.scheduler.core.block_manager import BlockManager, NoFreeBlocksError, chain_key, root_key
from jitney.scheduler.core.request import Request
from tests.support.fake_worker import make_request


def test_fresh_pool_hands_out_lowest_ids_first() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request(1, 9)
    assert bm.blocks_needed(a, 9) == 3
    assert bm.allocate_for(a, 9) == [0, 1, 2]
    assert a.block_ids == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 7)
    b = make_request(2, 1)
    assert bm.allocate_for(b, 1) == [3]
    bm.check_invariants()


def test_allocation_covers_only_the_new_positions() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    r = make_request(1, 20)
    assert bm.allocate_for(r, 5) == [0, 1]      # [0, 5)
    r.num_computed_tokens = 5
    assert bm.blocks_needed(r, 3) == 0          # [5, 8) fits in block 1
    assert bm.allocate_for(r, 3) == []
    r.num_computed_tokens = 8
    assert bm.blocks_needed(r, 1) == 1          # position 8 opens block 2
    assert bm.allocate_for(r, 1) == [2]
    assert r.block_ids == [0, 1, 2]
    assert bm.blocks_needed(r, 0) == 0


def test_free_returns_blocks_tail_first_to_the_back_of_the_queue() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)
    a, b = make_request(1, 6), make_request(2, 2)
    bm.allocate_for(a, 6)                       # 0, 1, 2
    bm.allocate_for(b, 2)                       # 3
    bm.free(a)
    assert a.block_ids == []
    assert [bm.ref_count(i) for i in range(5)] == [0, 0, 0, 1, 0]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (1, 4)
    c = make_request(3, 8)
    assert bm.allocate_for(c, 8) == [4, 2, 1, 0]
    bm.check_invariants()
    bm.free(b)
    bm.free(c)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_allocation_beyond_free_blocks_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    r = make_request(1, 12)
    assert not bm.can_allocate(bm.blocks_needed(r, 12))
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_for(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2
    assert bm.can_allocate(2) and not bm.can_allocate(3)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        BlockManager(4, 4).blocks_needed(make_request(1, 3), -1)


def test_double_free_is_detected() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    r = make_request(1, 4)
    bm.allocate_for(r, 4)
    stale = list(r.block_ids)
    bm.free(r)
    r.block_ids.extend(stale)
    with pytest.raises(AssertionError):
        bm.free(r)


def test_check_invariants_catches_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate_for(make_request(1, 4), 4)
    bm._free.append(0)                          # referenced and free
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm = BlockManager(num_blocks=4, block_size=4)
    bm._free.popleft()                          # neither free nor referenced
    with pytest.raises(AssertionError):
        bm.check_invariants()


# -- prefix cache ------------------------------------------------------------

def compute(bm: BlockManager, request: Request, n: int | None = None) -> list[int]:
    """Allocate and 'compute' the next ``n`` tokens (all by default) as one
    scheduled chunk, then register the blocks it filled, as the scheduler does."""
    start = request.num_computed_tokens
    n = request.num_tokens - start if n is None else n
    new = bm.allocate_for(request, n)
    request.num_computed_tokens += n
    bm.cache_full_blocks(request, start)
    return new


def board(bm: BlockManager, request: Request) -> list[int]:
    """Attach the cached prefix, as the scheduler does when a request boards."""
    cached = bm.find_cached_prefix(request)
    assert bm.can_board(cached, request.num_tokens)
    bm.attach_cached(request, cached)
    request.num_computed_tokens = len(cached) * bm.block_size
    return cached


def test_chain_keys_depend_on_parent_tokens_and_salt() -> None:
    root, salted = root_key(""), root_key("tenant-a")
    assert root != salted and root_key("") == root
    first = chain_key(root, [1, 2, 3, 4])
    assert first == chain_key(root, [1, 2, 3, 4])
    assert first != chain_key(salted, [1, 2, 3, 4])
    assert first != chain_key(root, [1, 2, 3, 5])
    # Same tokens in block 1, different block 0: different keys.
    other_first = chain_key(root, [9, 2, 3, 4])
    assert chain_key(first, [5, 6, 7, 8]) != chain_key(other_first, [5, 6, 7, 8])
    # Token ids are encoded at a fixed width: no ambiguity between 1, 23 and 12, 3.
    assert chain_key(root, [1, 23]) != chain_key(root, [12, 3])
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request(2, [9, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    compute(bm, b)
    assert a.block_keys[0] == first and a.block_keys[1] != b.block_keys[1]
    assert bm.num_cached_blocks == 4


def test_salted_requests_share_only_within_their_salt() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request(1, 9)
    compute(bm, a)
    salted = make_request(2, 9)
    salted.cache_salt = "tenant-a"
    assert bm.find_cached_prefix(salted) == []
    compute(bm, salted)
    same_salt = make_request(3, 9)
    same_salt.cache_salt = "tenant-a"
    assert board(bm, same_salt) == salted.block_ids[:2] == [3, 4]
    assert board(bm, make_request(4, 9)) == a.block_ids[:2] == [0, 1]


def test_hits_of_zero_partial_and_full_prefixes() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_request(1, 12)                              # tokens 1..12: 3 full blocks
    assert compute(bm, a) == [0, 1, 2]
    assert [bm.is_cached(b) for b in range(4)] == [True, True, True, False]
    none = make_request(2, [99] + list(range(2, 13)))
    partial = make_request(3, list(range(1, 9)) + [50, 51, 52, 53, 54])
    full = make_request(4, 13)
    assert bm.find_cached_prefix(none) == []
    assert bm.find_cached_prefix(partial) == [0, 1]
    assert board(bm, full) == [0, 1, 2]
    assert full.num_computed_tokens == 12 and compute(bm, full) == [3]
    assert (bm.prefix_cache_queried_tokens, bm.prefix_cache_hit_tokens) == (13, 12)
    bm.check_invariants()


def test_last_token_is_always_recomputed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    compute(bm, make_request(1, 12))
    assert bm.find_cached_prefix(make_request(2, 12)) == [0, 1]    # not the 3rd block
    assert bm.find_cached_prefix(make_request(3, 4)) == []         # one block, all of it
    assert bm.find_cached_prefix(make_request(4, 5)) == [0]
    assert bm.find_cached_prefix(make_request(5, 1)) == []


def test_ref_counts_with_several_sharers() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request(1, 9)
    compute(bm, a)                                       # 0, 1 full; 2 partial
    bm.free(a)
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (0, 10, 2)
    sharers = [make_request(i, list(range(1, 9)) + [100 + i]) for i in (2, 3, 4)]
    for r in sharers:
        assert board(bm, r) == [0, 1]
        compute(bm, r)
    assert [r.block_ids for r in sharers] == [[0, 1, 3], [0, 1, 4], [0, 1, 5]]
    assert [bm.ref_count(b) for b in range(6)] == [3, 3, 0, 1, 1, 1]
    assert bm.num_used_blocks == 5
    bm.free(sharers[0])
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 0, 0]
    bm.check_invariants()
    for r in sharers[1:]:
        bm.free(r)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2
    bm.check_invariants()


def test_idle_cached_blocks_are_evicted_last_and_least_recently_released_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_request(1, [1, 2, 3, 4]), make_request(2, [5, 6, 7, 8])
    c = make_request(3, [9])                             # a partial block: never cached
    compute(bm, a), compute(bm, b), compute(bm, c)       # 0 1 | 2 3 | 4
    bm.free(a)                                           # idle cached, LRU: 1, 0
    bm.free(c)                                           # plain free: 5, 4
    bm.free(b)                                           # LRU: 1, 0, 3, 2
    d = make_request(4, 12)
    assert bm.allocate_for(d, 12) == [5, 4, 1, 0, 3, 2]
    assert bm.num_cached_blocks == 0
    bm.check_invariants()


def test_an_attached_block_leaves_the_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request(1, [1, 2, 3, 4]), make_request(2, [5, 6, 7, 8])
    compute(bm, a), compute(bm, b)
    bm.free(a), bm.free(b)                               # LRU: 1, 0, 3, 2
    again = make_request(3, [1, 2, 3])
    assert board(bm, again) == [0]                       # LRU: 1, 3, 2
    assert bm.can_board([0], 3) and compute(bm, again) == [1]
    assert bm.find_cached_prefix(make_request(4, [1, 2, 3, 4, 5])) == [0]  # block 1 lost its key
    assert bm.allocate_for(make_request(5, 4), 4) == [3, 2]
    bm.check_invariants()


def test_evicted_block_is_recomputed_not_hit() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_request(1, [1, 2, 3])
    compute(bm, a)                                       # 0 cached, 1 partial
    bm.free(a)
    b = make_request(2, [7, 8, 9])
    assert compute(bm, b) == [1, 0]                      # plain free first, then evict 0
    assert bm.find_cached_prefix(make_request(3, [1, 2, 3])) == []
    assert bm.find_cached_prefix(make_request(4, [7, 8, 5])) == [1]
    bm.check_invariants()


def test_can_board_counts_idle_hits_as_taken() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request(1, [1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)                                           # 0, 1 cached idle; 2 plain free
    r = make_request(2, [1, 2, 3, 4, 9])
    cached = bm.find_cached_prefix(r)
    assert cached == [0, 1] and bm.can_board(cached, 5) and not bm.can_board(cached, 7)
    assert not bm.can_board([], 7) and bm.can_board([], 6)


def test_concurrent_computation_of_one_prefix_caches_one_block() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_request(1, [1, 2, 3]), make_request(2, [1, 2, 4])
    compute(bm, a), compute(bm, b)                       # both computed [1, 2]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    assert bm.is_cached(0) and not bm.is_cached(2)
    bm.free(b)
    assert bm.allocate_for(make_request(3, 2), 2) == [4]  # 2 and 3 are plain free
    bm.check_invariants()


def test_a_hash_collision_is_caught_by_the_stored_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import jitney.scheduler.core.block_manager as block_manager
    monkeypatch.setattr(block_manager, "chain_key", lambda parent, tokens: b"same")
    bm = BlockManager(num_blocks=6, block_size=2)
    compute(bm, make_request(1, [1, 2, 3]))
    assert bm.find_cached_prefix(make_request(2, [5, 6, 7])) == []
    assert bm.find_cached_prefix(make_request(3, [1, 2, 7])) == [0]


def test_reset_and_disabled_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request(1, [1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.find_cached_prefix(make_request(2, 5)) == []
    bm.check_invariants()
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    b = make_request(3, [1, 2, 3, 4, 5])
    compute(off, b)
    assert off.num_cached_blocks == 0
    off.free(b)
    c = make_request(4, [1, 2, 3, 4, 5])
    assert board(off, c) == [] and (off.prefix_cache_queried_tokens, off.prefix_cache_hit_tokens) == (0, 0)


def test_check_invariants_catches_cache_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request(1, [1, 2, 3])
    compute(bm, a)
    bm.free(a)
    bm._free.append(0)                                  # idle cached and plain free
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request(1, [1, 2, 3])
    compute(bm, a)
    bm._keys[1] = b"stray"                              # keyed but not indexed
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_a_block_whose_last_token_was_pending_is_cached_a_step_later() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    r = make_request(1, [1, 2, 3])
    compute(bm, r)                                       # block 0 cached, block 1 half full
    bm.allocate_for(r, 1)
    r.num_computed_tokens = 4                            # position 3: a sample not yet known
    bm.cache_full_blocks(r, 3)
    assert [bm.is_cached(b) for b in (0, 1)] == [True, False]
    r.output_token_ids.append(9)                         # the sample arrives
    bm.allocate_for(r, 1)
    r.num_computed_tokens = 5                            # the next decode, at position 4
    bm.cache_full_blocks(r, 4)
    assert [bm.is_cached(b) for b in (0, 1, 2)] == [True, True, False]
    assert bm.find_cached_prefix(make_request(2, [1, 2, 3, 9, 7])) == [0, 1]

"""BlockManager: exact block ids, ref counts, free queue order."""

from __future__ import annotations

import pytest

from scheduler.block_manager import BlockManager, NoFreeBlocksError
from fake_worker import make_request


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

"""The logical KV cache: block ids, reference counts and the free queue.

Bookkeeping only, no policy: the scheduler decides who gets blocks; this
class hands them out and takes them back. The worker owns the tensors.

    block state   ref_count   in free queue
    free          0           yes (once)
    in use        >= 1        no

A request's block table (``request.block_ids``) covers positions
``[0, len(block_ids) * block_size)``; slot of position p is
``block_ids[p // block_size]``, offset ``p % block_size``.

Prefix caching (later) plugs in here without changing the interface: full
blocks get a hash-chain key, ``allocate_for`` first looks the request's full
prompt blocks up and shares hits (ref_count += 1), released blocks keep their
key while at ref 0 in the free queue (which becomes an LRU with O(1) removal),
and ``_take_free_block`` drops the key of the block it recycles. All free
queue traffic already goes through ``_take_free_block``/``_release_block``.
"""

from __future__ import annotations

from collections import deque

from scheduler.request import Request


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free (a scheduler bug)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class BlockManager:
    """Reference-counted fixed-size KV-cache blocks.

    A fresh pool hands out the lowest ids first (0, 1, 2, ...); freed blocks go
    to the back of the free queue, so a block's reuse is as late as possible.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self._block_size = block_size
        self._ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._ref_counts[block_id]

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to append so the table covers the next ``num_new_tokens``.

        Coverage wanted: ``[0, num_computed_tokens + num_new_tokens)``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        end = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(end, self._block_size) - len(request.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks are free now."""
        return num_blocks <= len(self._free)

    def allocate_for(self, request: Request, num_new_tokens: int) -> list[int]:
        """Append the blocks the next ``num_new_tokens`` need to the table.

        Returns the new block ids (possibly none). Raises
        ``NoFreeBlocksError`` and changes nothing if too few are free.
        """
        needed = self.blocks_needed(request, num_new_tokens)
        if not self.can_allocate(needed):
            raise NoFreeBlocksError(
                f"seq {request.seq_id} needs {needed} blocks, {len(self._free)} free")
        new_ids = [self._take_free_block() for _ in range(needed)]
        request.block_ids.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Drop the request's references and clear its block table.

        Tail first: with prefix caching, a sequence's last blocks are the
        least likely to be shared, so they should be evicted first.
        """
        for block_id in reversed(request.block_ids):
            self._release_block(block_id)
        request.block_ids.clear()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if ref counts and the free queue disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free queue twice")
        for block_id, refs in enumerate(self._ref_counts):
            if refs < 0:
                raise AssertionError(f"block {block_id} has ref count {refs}")
            if (refs == 0) != (block_id in free):
                raise AssertionError(
                    f"block {block_id}: ref count {refs}, "
                    f"{'in' if block_id in free else 'not in'} the free queue")

    def _take_free_block(self) -> int:
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        refs = self._ref_counts[block_id]
        if refs < 1:
            raise AssertionError(f"block {block_id} released while free")
        self._ref_counts[block_id] = refs - 1
        if refs == 1:
            self._free.append(block_id)

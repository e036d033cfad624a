"""The logical KV cache: block ids, reference counts, free blocks, prefix cache.

Bookkeeping only, no policy: the scheduler decides who gets blocks; this
class hands them out and takes them back. The worker owns the tensors.

    block state    ref_count   key    kept in
    free           0           none   _free       FIFO, handed out first
    cached, idle   0           set    _evictable  LRU (oldest first), O(1)
    in use         >= 1        any    one block table, or several if cached

A request's block table (``request.block_ids``) covers positions
``[0, len(block_ids) * block_size)``; slot of position p is
``block_ids[p // block_size]``, offset ``p % block_size``.

Prefix cache. Only *full* blocks get a key, chained from the parent's key:

    root          = sha256("jitney-prefix-v1\\0" + cache_salt [+ "\\0lora:" + adapter id])
    key(block i)  = sha256(key(block i-1) + token ids of block i, uint64 LE)

so one key names the whole token prefix up to the end of block i, for one
salt and adapter (tenants with different salts never share; nor do LoRA
adapters, keyed by their registration id, lora.py). A cached block also keeps
its parent key and token ids, and every hit is checked against them.

* A full block is registered (``cache_full_blocks``) once the chunk that
  fills it is scheduled; the scheduler does that at the end of ``schedule``,
  so a block can be attached at the earliest by the next step, which the
  worker runs after the step that writes the block.
* Boarding (``find_cached_prefix`` + ``attach_cached``) attaches the longest
  run of cached blocks (ref + 1), capped so at least the last token is
  computed (there must be logits to sample from).
* Released blocks keep their key at ref 0 in ``_evictable``; they are reused
  only when ``_free`` is empty, least recently released first, and lose their
  key then. A cached block is full, so nobody ever writes it again: new
  tokens land only in blocks a single request owns.

Sliding windows (``window`` > 0: every layer of the model attends at most
``window`` keys back, the largest window of its layers). A query at position
p reads keys ``[p - window + 1, p]``, so once a request's next position is q,
its blocks before ``window_start(q)`` are never read again, by any layer:

    table entry i < window_start(num_computed_tokens)   -> released (null_block)
    table entry i >= it                                 -> held (ref >= 1)

``release_before_window`` drops them (ref - 1; a keyed one stays in the prefix
cache, idle), leaving ``null_block`` in the table: an id the pool never hands
out (the last one), so the worker's gathers always index a real block, which
no attention reads (a window skips blocks wholly before it, and their table
entries). A request then holds about ``cdiv(window + chunk, block_size) + 1``
blocks, however long it grows. A prefix hit at block h needs only the blocks
its first query reads, ``[window_start(h * block_size), h)``, cached; the
entries before are null. Keys still chain over every token, so a hit names
the whole prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

from jitney.scheduler.core.request import Request


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free (a scheduler bug)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def root_key(cache_salt: str, lora_id: int = 0) -> bytes:
    """The parent key of a sequence's first block; ``lora_id``: its adapter's
    registration id (lora.py; 0, the base model, keeps the base's keys)."""
    lora = f"\0lora:{lora_id}".encode() if lora_id else b""
    return hashlib.sha256(b"jitney-prefix-v1\0" + cache_salt.encode("utf-8") + lora).digest()


def chain_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: its parent's key and its own token ids."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}Q", *token_ids)).digest()


class BlockManager:
    """Reference-counted fixed-size KV-cache blocks with a prefix cache.

    A fresh pool hands out the lowest ids first (0, 1, 2, ...); freed blocks go
    to the back of their queue, so a block's reuse is as late as possible.
    ``num_blocks`` is the worker's; with a ``window`` the last one is the null
    block, outside the pool (``num_blocks`` then reports one fewer).
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, window: int = 0) -> None:
        if num_blocks < 1 + (window > 0) or block_size < 1 or window < 0:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1 (2 with a window), block_size "
                             f"({block_size}) >= 1 and window ({window}) >= 0")
        self._block_size = block_size
        self._enabled = enable_prefix_caching
        self._window = window
        num_blocks -= window > 0
        self.null_block = num_blocks if window else -1   # -1: no null block without a window
        self._ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[bytes, int] = {}                       # key -> block id
        self._keys: list[bytes | None] = [None] * num_blocks     # block id -> key
        self._stored: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        self.prefix_cache_queried_tokens = 0   # tokens of boarding requests
        self.prefix_cache_hit_tokens = 0       # of those, served by the cache

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (the null block not counted)."""
        return len(self._ref_counts)

    @property
    def window(self) -> int:
        """Every layer's window is at most this (0: some layer reads everything)."""
        return self._window

    def window_start(self, position: int) -> int:
        """The first block a query at ``position`` (or any later one) reads."""
        return max(0, position - self._window + 1) // self._block_size if self._window else 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached ones included (they are reusable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a prefix-cache key, in use or idle."""
        return len(self._index)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._keys[block_id] is not None

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
        return num_blocks <= self.num_free_blocks

    def allocate_for(self, request: Request, num_new_tokens: int) -> list[int]:
        """Append the blocks the next ``num_new_tokens`` need to the table.

        Returns the new block ids (possibly none). Raises
        ``NoFreeBlocksError`` and changes nothing if too few are free.
        """
        needed = self.blocks_needed(request, num_new_tokens)
        if not self.can_allocate(needed):
            raise NoFreeBlocksError(
                f"seq {request.seq_id} needs {needed} blocks, {self.num_free_blocks} free")
        new_ids = [self._take_free_block() for _ in range(needed)]
        request.block_ids.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Drop the request's references and clear its block table.

        Tail first: a sequence's last blocks are the least likely to be
        shared, so they are released (and later evicted) first.
        """
        for block_id in reversed(request.block_ids):
            if block_id != self.null_block:
                self._release_block(block_id)
        request.block_ids.clear()

    def truncate(self, request: Request, num_blocks: int) -> None:
        """Cut the table to its first ``num_blocks`` entries, releasing the
        others tail first (they held only rejected drafts' K/V)."""
        ids = request.block_ids
        for block_id in reversed(ids[num_blocks:]):
            if block_id != self.null_block:
                self._release_block(block_id)
        del ids[num_blocks:]

    def release_before_window(self, request: Request) -> int:
        """Release the blocks no later query of ``request`` reads (before the
        window of position ``num_computed_tokens``); returns how many.

        Oldest first, so the prefix cache evicts them in that order. Entries
        before the first null are released already (released ones form a prefix).
        """
        ids = request.block_ids
        end = min(self.window_start(request.num_computed_tokens), len(ids))
        begin = end
        while begin > 0 and ids[begin - 1] != self.null_block:
            begin -= 1
        for i in range(begin, end):
            self._release_block(ids[i])
            ids[i] = self.null_block
        return end - begin

    def covers_window(self, blocks: Sequence[int]) -> bool:
        """Whether a table prefix of ``blocks`` holds every block a query just
        past it reads (no null entry from its window's first block on)."""
        start = self.window_start(len(blocks) * self._block_size)
        return self.null_block not in blocks[start:]

    # -- prefix cache ------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of a request with no blocks.

        Whole blocks only, and at most ``num_tokens - 1`` tokens, so the last
        token is always computed. Changes nothing; empty when disabled.
        """
        if not self._enabled or request.block_ids:
            return []
        max_blocks = (request.num_tokens - 1) // self._block_size
        tokens = request.all_token_ids if max_blocks else []
        if self._window:
            return self._find_windowed_prefix(request, max_blocks, tokens)
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached_block(request, i, tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _find_windowed_prefix(self, request: Request, max_blocks: int, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of h blocks whose window blocks ``[window_start(h
        * block_size), h)`` are all cached (earlier ones may have been evicted):
        null entries, then those blocks."""
        found: list[int | None] = []
        best = run = 0     # run: cached blocks in a row ending at block i
        for i in range(max_blocks):
            found.append(self._cached_block(request, i, tokens))
            run = run + 1 if found[i] is not None else 0
            if run >= i + 1 - self.window_start((i + 1) * self._block_size):
                best = i + 1
        start = self.window_start(best * self._block_size)
        return [self.null_block] * start + [b for b in found[start:best] if b is not None]

    def _cached_block(self, request: Request, i: int, tokens: Sequence[int]) -> int | None:
        """The cached block that holds the request's block ``i``, if any."""
        block_id = self._index.get(self._block_key(request, i, tokens))
        return block_id if block_id is not None and self._holds(block_id, request, i, tokens) else None

    def can_board(self, cached: Sequence[int], num_tokens: int) -> bool:
        """Whether a request with no blocks can attach ``cached`` and get
        new blocks for the rest of ``[0, num_tokens)``."""
        idle = sum(1 for b in cached if b != self.null_block and self._ref_counts[b] == 0)
        return cdiv(num_tokens, self._block_size) - len(cached) + idle <= self.num_free_blocks

    def attach_cached(self, request: Request, cached: Sequence[int]) -> None:
        """Share ``cached`` (from ``find_cached_prefix``) as the start of the
        request's empty table, and count the query and the hit."""
        if request.block_ids:
            raise AssertionError(f"seq {request.seq_id} boards holding blocks")
        for block_id in cached:
            if block_id == self.null_block:
                continue
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
        request.block_ids.extend(cached)
        if self._enabled:
            self.prefix_cache_queried_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += len(cached) * self._block_size

    def share_blocks(self, request: Request, blocks: Sequence[int]) -> None:
        """Start the empty table of ``request`` with ``blocks`` that another
        running request holds (full, computed prompt blocks of an n > 1
        parent): ref + 1 each, not counted as prefix-cache hits. Null entries
        are copied as they are (``covers_window`` says whether that is enough)."""
        if request.block_ids:
            raise AssertionError(f"seq {request.seq_id} boards holding blocks")
        for block_id in blocks:
            if block_id == self.null_block:
                continue
            if self._ref_counts[block_id] < 1:
                raise AssertionError(f"block {block_id} shared while idle")
            self._ref_counts[block_id] += 1
        request.block_ids.extend(blocks)

    def cache_full_blocks(self, request: Request, first_position: int) -> None:
        """Register the blocks that positions ``[first_position,
        num_computed_tokens)`` filled (only blocks whose tokens are all known).

        The block before ``first_position`` is checked again: when steps
        overlap, its last token may have been a placeholder last time. A
        prefix already cached in another block (two requests computed it at
        once) keeps that block; this one stays unkeyed. A block released
        already (a window shorter than a block) stays unkeyed too.
        """
        end = min(request.num_computed_tokens, request.num_tokens) // self._block_size
        begin = max(0, first_position // self._block_size - 1)
        if not self._enabled or begin >= end:
            return
        tokens = request.all_token_ids
        for i in range(begin, end):
            key = self._block_key(request, i, tokens)
            block_id = request.block_ids[i]
            if block_id == self.null_block or key in self._index or self._keys[block_id] is not None:
                continue
            self._index[key] = block_id
            self._keys[block_id] = key
            self._stored[block_id] = (self._parent_key(request, i),
                                      tuple(tokens[i * self._block_size:(i + 1) * self._block_size]))

    def reset_prefix_cache(self) -> None:
        """Forget every key (the worker's cache contents can no longer be
        trusted); idle cached blocks become plain free blocks."""
        self._index.clear()
        self._keys = [None] * self.num_blocks
        self._stored = [None] * self.num_blocks
        self._free.extend(self._evictable)
        self._evictable.clear()

    def _block_key(self, request: Request, i: int, tokens: Sequence[int]) -> bytes:
        """Key of the request's block ``i``, memoised on ``request.block_keys``
        (the tokens of a position never change)."""
        keys = request.block_keys
        while len(keys) <= i:
            n, size = len(keys), self._block_size
            keys.append(chain_key(self._parent_key(request, n), tokens[n * size:(n + 1) * size]))
        return keys[i]

    def _parent_key(self, request: Request, i: int) -> bytes:
        return request.block_keys[i - 1] if i else root_key(request.cache_salt, request.lora_id)

    def _holds(self, block_id: int, request: Request, i: int, tokens: Sequence[int]) -> bool:
        """Whether cached ``block_id`` really holds the request's block ``i``."""
        size = self._block_size
        return self._stored[block_id] == (self._parent_key(request, i),
                                          tuple(tokens[i * size:(i + 1) * size]))

    # -- the free queues -----------------------------------------------------
    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)   # least recently used
            key = self._keys[block_id]
            assert key is not None
            del self._index[key]
            self._keys[block_id] = None
            self._stored[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        refs = self._ref_counts[block_id]
        if refs < 1:
            raise AssertionError(f"block {block_id} released while free")
        self._ref_counts[block_id] = refs - 1
        if refs > 1:
            return
        if self._keys[block_id] is None:
            self._free.append(block_id)
        else:
            self._evictable[block_id] = None

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if ref counts, queues and keys disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free queue twice")
        if free & self._evictable.keys():
            raise AssertionError("a block is both free and cached-idle")
        for block_id, refs in enumerate(self._ref_counts):
            idle = block_id in free or block_id in self._evictable
            if refs < 0:
                raise AssertionError(f"block {block_id} has ref count {refs}")
            if (refs == 0) != idle:
                raise AssertionError(
                    f"block {block_id}: ref count {refs}, {'' if idle else 'not '}idle")
            key = self._keys[block_id]
            if (key is None) == (block_id in self._evictable) and idle:
                raise AssertionError(f"block {block_id}: key and free queue disagree")
            if key is not None and self._index.get(key) != block_id:
                raise AssertionError(f"block {block_id}: key not indexed to it")
        if len(self._index) != sum(k is not None for k in self._keys):
            raise AssertionError("the key index and the block keys disagree")

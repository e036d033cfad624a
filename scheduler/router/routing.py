"""Where `jitney router` sends a request: the policy alone, no I/O.

    policy        picks
    round-robin   the next serving replica in turn
    least-loaded  the replica with the fewest requests in flight + waiting
    cache-aware   the replica that was sent the longest prefix of this prompt
                  (in whole KV blocks, same cache_salt), unless it is
                  overloaded; with no useful prefix, the least loaded

The router cannot see the replicas' caches, so it remembers what it sent
where: per replica, a ``PrefixTable`` of block hashes (a hash chain, as the
replicas' block managers key their prefix cache), LRU-bounded to about the
blocks that replica's cache holds. It is an estimate: a replica may have
evicted a block the table still lists, or cached one the table never saw
(traffic that bypassed the router). A wrong guess costs a recompute, never
a wrong answer. Ties (same prefix, same load) rotate, so equal replicas
share the work.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("cache-aware", "least-loaded", "round-robin")

# (cache_salt, chain hash of the blocks up to and including this one). The
# salt is part of the key, not only of the chain's seed, so two tenants never
# share an entry even if their hashes collided.
BlockKey = tuple[str, int]


def block_keys(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[BlockKey]:
    """One key per whole block of ``token_ids``; key i covers blocks 0..i
    (a partial last block has none: the replicas cache whole blocks only)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys = []
    chain = hash(("jitney-route", cache_salt))
    for end in range(block_size, len(token_ids) + 1, block_size):
        chain = hash((chain, tuple(token_ids[end - block_size:end])))
        keys.append((cache_salt, chain))
    return keys


class PrefixTable:
    """Block keys sent to one replica, at most ``capacity``, least recently
    sent evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of ``keys`` this replica was sent."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def record(self, keys: Sequence[BlockKey]) -> None:
        """Remember ``keys`` as sent now. The deepest block is touched first,
        so a chain's root is the newest entry and its tail is evicted before
        it (a root without its tail still matches; a tail without its root
        would be dead weight)."""
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


@dataclass(frozen=True)
class Candidate:
    """A serving replica as the policy sees it."""

    name: str
    load: int          # requests in flight there (this router's and others')
    block_size: int    # its KV block size, from GetModelInfo


@dataclass(frozen=True)
class Prompt:
    """What cache-aware routing reads of a request: its prompt's token ids."""

    token_ids: Sequence[int]
    cache_salt: str = ""


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str          # "prefix" | "least-loaded" | "overloaded" | "round-robin"
    matched_blocks: int = 0


@dataclass(frozen=True)
class RoutingConfig:
    """``overload_threshold``: the best-prefix replica is passed over when its
    load exceeds the least loaded replica's by more than this many requests.
    ``min_prefix_blocks``: fewer matched blocks is no useful prefix.
    ``table_blocks``: a replica's table capacity when its cache size is
    unknown, and the cap on any table."""

    policy: str = "cache-aware"
    overload_threshold: int = 8
    min_prefix_blocks: int = 1
    table_blocks: int = 262_144

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.overload_threshold < 0 or self.min_prefix_blocks < 1 or self.table_blocks < 1:
            raise ValueError("overload_threshold must be >= 0, min_prefix_blocks and table_blocks >= 1")


class RoutingPolicy:
    """Chooses a replica per request and keeps the per-replica prefix tables."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._tables: dict[str, PrefixTable] = {}
        self._turn = itertools.count()

    def table(self, name: str) -> PrefixTable:
        if name not in self._tables:
            self._tables[name] = PrefixTable(self.config.table_blocks)
        return self._tables[name]

    def set_capacity(self, name: str, num_kv_blocks: int) -> None:
        """Bound ``name``'s table by its cache size (it cannot hold more)."""
        table = self.table(name)
        table.capacity = max(1, min(num_kv_blocks, self.config.table_blocks))
        table.record([])     # evicts down to the new capacity

    def forget(self, name: str) -> None:
        """``name`` lost its cache (a restart): nothing was sent there."""
        self.table(name).clear()

    def choose(self, candidates: Sequence[Candidate], prompt: Prompt | None) -> Choice:
        """The replica for a request. ``candidates``: the serving replicas,
        in a stable order, at least one; ``prompt``: None when its token ids
        are unknown (routed by load)."""
        if not candidates:
            raise ValueError("no candidates")
        turn = next(self._turn)
        if self.config.policy == "round-robin":
            return Choice(candidates[turn % len(candidates)].name, "round-robin")
        least = self._least_loaded(candidates, turn)
        if self.config.policy == "least-loaded" or prompt is None:
            return Choice(least.name, "least-loaded")
        matched = self._matches(candidates, prompt)
        best_blocks = max(matched)
        if best_blocks < self.config.min_prefix_blocks:
            return Choice(least.name, "least-loaded")
        best = self._least_loaded([c for c, m in zip(candidates, matched) if m == best_blocks], turn)
        if best.load > least.load + self.config.overload_threshold:
            return Choice(least.name, "overloaded", matched[candidates.index(least)])
        return Choice(best.name, "prefix", best_blocks)

    def record(self, name: str, block_size: int, prompt: Prompt | None) -> None:
        """``prompt`` was sent to ``name``: its blocks are likely cached there soon."""
        if prompt is not None and self.config.policy == "cache-aware":
            self.table(name).record(block_keys(prompt.token_ids, block_size, prompt.cache_salt))

    def _matches(self, candidates: Sequence[Candidate], prompt: Prompt) -> list[int]:
        keys_by_size: dict[int, list[BlockKey]] = {}
        out = []
        for c in candidates:
            if c.block_size not in keys_by_size:
                keys_by_size[c.block_size] = block_keys(prompt.token_ids, c.block_size, prompt.cache_salt)
            out.append(self.table(c.name).match(keys_by_size[c.block_size]))
        return out

    @staticmethod
    def _least_loaded(candidates: Sequence[Candidate], turn: int) -> Candidate:
        """Fewest load; among equals, the first at or after position ``turn``."""
        n = len(candidates)
        return min(enumerate(candidates), key=lambda ic: (ic[1].load, (ic[0] - turn) % n))[1]

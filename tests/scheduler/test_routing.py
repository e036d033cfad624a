"""The router's policy (scheduler/router/routing.py), without processes: which
replica each request goes to, the prefix tables' LRU bound and salts."""

from __future__ import annotations

import pytest

from jitney.scheduler.router.routing import (Candidate, PrefixTable, Prompt, RoutingConfig, RoutingPolicy,
                                      block_keys)

BS = 4
SHARED = list(range(100, 116))           # four whole blocks


def cands(*loads: int, block_size: int = BS) -> list[Candidate]:
    return [Candidate(f"r{i}", load, block_size) for i, load in enumerate(loads)]


def route(policy: RoutingPolicy, candidates: list[Candidate], ids: list[int], salt: str = "") -> str:
    prompt = Prompt(ids, salt)
    choice = policy.choose(candidates, prompt)
    policy.record(choice.name, BS, prompt)
    return choice.name


def test_block_keys_are_a_chain_of_whole_blocks() -> None:
    keys = block_keys(SHARED + [1, 2, 3], BS)
    assert len(keys) == 4                                  # the partial block has no key
    assert block_keys(SHARED + [9], BS) == keys            # a key covers everything before it
    assert block_keys([0] + SHARED[1:], BS)[1] != keys[1]  # ... so an early change changes all
    assert block_keys(SHARED, BS, "tenant-a") != keys
    with pytest.raises(ValueError):
        block_keys(SHARED, 0)


def test_shared_prefix_goes_where_it_went_before() -> None:
    policy = RoutingPolicy(RoutingConfig())
    first = route(policy, cands(0, 0), SHARED + [1])
    # Now the other replica is less loaded, but the prefix is on the first.
    loads = (3, 0) if first == "r0" else (0, 3)
    for tail in range(2, 6):
        choice = policy.choose(cands(*loads), Prompt(SHARED + [tail]))
        assert (choice.name, choice.reason, choice.matched_blocks) == (first, "prefix", 4)


def test_no_useful_prefix_goes_to_the_least_loaded() -> None:
    policy = RoutingPolicy(RoutingConfig(min_prefix_blocks=2))
    route(policy, cands(0, 5), SHARED)                      # r0
    assert policy.choose(cands(3, 1), Prompt([7] * 16)).name == "r1"
    short = SHARED[:BS] + [0] * 12                          # one block in common: below the minimum
    assert policy.choose(cands(3, 1), Prompt(short)) == policy.choose(cands(3, 1), Prompt([7] * 16))
    assert policy.choose(cands(3, 1), Prompt(SHARED[:8] + [0] * 8)).name == "r0"


def test_an_overloaded_prefix_holder_is_passed_over() -> None:
    policy = RoutingPolicy(RoutingConfig(overload_threshold=2))
    assert route(policy, cands(0, 1), SHARED) == "r0"
    assert policy.choose(cands(3, 1), Prompt(SHARED)).name == "r0"      # 3 <= 1 + 2
    choice = policy.choose(cands(4, 1), Prompt(SHARED))                # 4 > 1 + 2
    assert (choice.name, choice.reason) == ("r1", "overloaded")
    policy.record("r1", BS, Prompt(SHARED))
    # Both hold it now: the less loaded of the two.
    assert policy.choose(cands(4, 1), Prompt(SHARED)).reason == "prefix"
    assert policy.choose(cands(4, 1), Prompt(SHARED)).name == "r1"
    assert policy.choose(cands(1, 4), Prompt(SHARED)).name == "r0"


def test_the_longest_match_wins_over_a_shorter_one() -> None:
    policy = RoutingPolicy(RoutingConfig())
    policy.record("r0", BS, Prompt(SHARED[:8]))
    policy.record("r1", BS, Prompt(SHARED))
    choice = policy.choose(cands(2, 4), Prompt(SHARED + [5]))
    assert (choice.name, choice.matched_blocks) == ("r1", 4)


def test_tenants_never_share_routing_state() -> None:
    policy = RoutingPolicy(RoutingConfig())
    policy.record("r0", BS, Prompt(SHARED, "tenant-a"))
    assert policy.choose(cands(5, 0), Prompt(SHARED, "tenant-b")).reason == "least-loaded"
    assert policy.choose(cands(5, 0), Prompt(SHARED, "")).reason == "least-loaded"
    assert policy.choose(cands(5, 0), Prompt(SHARED, "tenant-a")).name == "r0"


def test_ties_rotate_between_equal_replicas() -> None:
    policy = RoutingPolicy(RoutingConfig(policy="least-loaded"))
    names = [policy.choose(cands(0, 0, 0), None).name for _ in range(6)]
    assert names == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert policy.choose(cands(2, 0, 1), None).name == "r1"


def test_round_robin_ignores_load_and_prefixes() -> None:
    policy = RoutingPolicy(RoutingConfig(policy="round-robin"))
    names = [route(policy, cands(0, 9), SHARED) for _ in range(4)]
    assert names == ["r0", "r1", "r0", "r1"]
    assert len(policy.table("r0")) == 0                     # it keeps no tables


def test_unknown_token_ids_route_by_load() -> None:
    policy = RoutingPolicy(RoutingConfig())
    route(policy, cands(0, 0), SHARED)
    assert policy.choose(cands(1, 0), None).name == "r1"
    with pytest.raises(ValueError):
        policy.choose([], None)


def test_prefix_table_evicts_the_least_recently_sent_tails_first() -> None:
    table = PrefixTable(capacity=6)
    a, b = block_keys(SHARED, BS), block_keys([1] * 16, BS)
    table.record(a)
    table.record(b)                          # 8 keys > 6: a's two deepest blocks go
    assert table.match(a) == 2 and table.match(b) == 4
    table.record(a[:2])                      # a's root is touched again: b's tail goes next
    table.record(block_keys([2] * 4, BS))
    assert table.match(a) == 2 and table.match(b) == 3
    assert len(table) == 6


def test_a_replica_table_is_bounded_by_its_cache_and_forgotten_on_restart() -> None:
    policy = RoutingPolicy(RoutingConfig(table_blocks=100))
    policy.set_capacity("r0", 3)
    policy.record("r0", BS, Prompt(SHARED))
    assert len(policy.table("r0")) == 3 and policy.table("r0").match(block_keys(SHARED, BS)) == 3
    policy.set_capacity("r1", 10_000)
    assert policy.table("r1").capacity == 100
    policy.forget("r0")
    assert policy.choose(cands(1, 0), Prompt(SHARED)).reason == "least-loaded"


def test_replicas_of_different_block_sizes_are_matched_in_their_own_blocks() -> None:
    policy = RoutingPolicy(RoutingConfig())
    policy.record("r1", 8, Prompt(SHARED))
    mixed = [Candidate("r0", 0, BS), Candidate("r1", 3, 8)]
    choice = policy.choose(mixed, Prompt(SHARED))
    assert (choice.name, choice.matched_blocks) == ("r1", 2)


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError):
        RoutingConfig(min_prefix_blocks=0)

"""LoRA slot residency in the scheduler (core/lora.py), driven through the fake
worker, which checks the contract: a load goes into a slot no live sequence
uses, a new sequence's slot holds an adapter, and a sequence never reads K/V
computed under another adapter. Each adapter moves the fake model's tokens
(``lora_shift``), so a sequence run with the wrong adapter gets wrong tokens.
"""

from __future__ import annotations

import pytest

from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.lora import LoraSlots
from jitney.scheduler.core.request import FinishReason, Request
from jitney.scheduler.core.scheduler import Scheduler
from tests.support.fake_worker import (FakeWorker, PlanError, drive_step, lora_reference_output, make_request,
                                       run_pipelined, run_until_idle, wire_plan)

ADAPTERS = {1: "/adapters/a", 2: "/adapters/b", 3: "/adapters/c"}


def make(max_loras: int = 2, num_blocks: int = 64, max_num_seqs: int = 8, **kw: int) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(block_size=4, num_blocks=num_blocks, max_model_len=64, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=64, max_loras=max_loras, **kw)  # type: ignore[arg-type]
    return Scheduler(config), FakeWorker.for_config(config)


def lora_request(seq_id: int, lora_id: int, prompt: list[int] | int = 6, max_tokens: int = 4) -> Request:
    request = make_request(seq_id, prompt, max_tokens=max_tokens)
    if lora_id:
        request.lora_id, request.lora_name, request.lora_path = lora_id, f"lora-{lora_id}", ADAPTERS[lora_id]
    return request


def assert_idle(s: Scheduler, w: FakeWorker) -> None:
    assert not s.has_work() and w.seqs == {} and w.holders == {} and w.lora_of == {}
    assert s.block_manager.num_used_blocks == 0
    assert all(holders == 0 for _, _, holders in s.lora.resident())


def test_three_adapters_two_slots_all_finish_with_their_adapter() -> None:
    s, w = make(max_loras=2)
    requests = [lora_request(i + 1, lora_id=i % 4, prompt=[i + 1] * 6, max_tokens=5) for i in range(12)]
    for r in requests:
        s.add_request(r)
    run_until_idle(s, w)
    for r in requests:
        assert r.finish_reason is FinishReason.LENGTH
        assert r.output_token_ids == lora_reference_output(r.prompt_token_ids, 5, r.lora_path), r.seq_id
    assert {name for _, name in w.lora_loads} == {"lora-1", "lora-2", "lora-3"}
    assert_idle(s, w)


def test_pipelined_with_preemption_keeps_the_contract() -> None:
    # A small cache preempts; two plans in flight: the fake worker checks every load.
    s, w = make(max_loras=2, num_blocks=16, max_num_seqs=6)
    requests = [lora_request(i + 1, lora_id=i % 4, prompt=[i + 2] * 9, max_tokens=12) for i in range(10)]
    for r in requests:
        s.add_request(r)
    outputs = run_pipelined(s, w, depth=2)
    assert any(o.preempted for o in outputs)
    for r in requests:
        assert r.output_token_ids == lora_reference_output(r.prompt_token_ids, 12, r.lora_path)
    assert_idle(s, w)


def test_a_request_waits_for_a_slot_and_others_board_meanwhile() -> None:
    s, w = make(max_loras=1)
    a = lora_request(1, 1, max_tokens=6)
    s.add_request(a)
    drive_step(s, w)
    b, base = lora_request(2, 2), lora_request(3, 0)
    s.add_request(b)
    s.add_request(base)
    output, _ = drive_step(s, w)
    boarded = {r.seq_id for r in output.new_seqs}
    assert boarded == {3}, "the base request boards past the one waiting for a slot"
    assert not output.lora_loads
    while not a.is_finished:
        output, _ = drive_step(s, w)
        assert b not in output.new_seqs
    run_until_idle(s, w)
    assert b.output_token_ids == lora_reference_output(b.prompt_token_ids, 4, ADAPTERS[2])
    assert w.lora_loads == [(1, "lora-1"), (1, "lora-2")]
    assert_idle(s, w)


def test_a_draining_slot_takes_no_new_riders_so_the_waiter_is_not_starved() -> None:
    s, w = make(max_loras=1)
    s.add_request(lora_request(1, 1, max_tokens=3))
    drive_step(s, w)
    waiter = lora_request(2, 2, max_tokens=2)
    s.add_request(waiter)
    drive_step(s, w)             # the waiter marks slot 1 draining
    late = lora_request(3, 1, max_tokens=2)   # adapter 1 is resident but draining
    s.add_request(late)
    output, _ = drive_step(s, w)
    assert late not in output.new_seqs
    run_until_idle(s, w)
    assert waiter.is_finished and late.is_finished
    assert [name for _, name in w.lora_loads] == ["lora-1", "lora-2", "lora-1"]
    assert_idle(s, w)


def test_lru_eviction_takes_the_least_recently_used_unheld_slot() -> None:
    s, w = make(max_loras=2)
    for seq_id, lora_id in ((1, 1), (2, 2)):
        s.add_request(lora_request(seq_id, lora_id, max_tokens=1))
        run_until_idle(s, w)
    s.add_request(lora_request(3, 1, max_tokens=1))    # adapter 1 used again: 2 is now the LRU
    run_until_idle(s, w)
    s.add_request(lora_request(4, 3, max_tokens=1))
    run_until_idle(s, w)
    assert w.lora_loads == [(1, "lora-1"), (2, "lora-2"), (2, "lora-3")]
    assert sorted(name for _, name, _ in s.lora.resident()) == ["lora-1", "lora-3"]


def test_cancel_and_unload_while_running_free_the_slot() -> None:
    s, w = make(max_loras=1)
    a, b = lora_request(1, 1, max_tokens=20), lora_request(2, 1, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    drive_step(s, w)
    s.lora.retire(1)             # unloaded: running requests finish on it
    assert s.lora.resident() == [(1, "lora-1", 2)]
    s.abort_request(a.seq_id, FinishReason.CANCELLED)
    drive_step(s, w)
    assert s.lora.resident() == [(1, "lora-1", 1)]
    run_until_idle(s, w)
    assert b.output_token_ids == lora_reference_output(b.prompt_token_ids, 20, ADAPTERS[1])
    assert s.lora.resident() == []       # emptied with its last sequence
    assert_idle(s, w)


def test_recovery_forgets_the_loaded_slots() -> None:
    s, w = make(max_loras=1)
    r = lora_request(1, 1, max_tokens=4)
    s.add_request(r)
    lost = s.schedule()          # its plan failed on the worker (its load may not have run)
    s.recover_from_failed_step([lost])
    output = s.schedule()
    assert output.reset and [(o.slot, o.name) for o in output.lora_loads] == [(1, "lora-1")]
    assert r in output.new_seqs and r.lora_slot == 1


def test_prefix_cache_is_per_adapter() -> None:
    s, w = make(max_loras=2)
    prompt = list(range(1, 18))
    first = lora_request(1, 1, prompt)
    s.add_request(first)
    run_until_idle(s, w)
    other, same, base = lora_request(2, 2, prompt), lora_request(3, 1, prompt), lora_request(4, 0, prompt)
    for r in (other, same, base):
        s.add_request(r)
        run_until_idle(s, w)     # the fake worker raises on K/V of another adapter
    assert (other.num_cached_tokens, same.num_cached_tokens, base.num_cached_tokens) == (0, 16, 0)
    for r in (first, other, same, base):
        assert r.output_token_ids == lora_reference_output(prompt, 4, r.lora_path)


def test_fake_worker_refuses_a_reload_of_a_held_slot() -> None:
    s, w = make(max_loras=1)
    s.add_request(lora_request(1, 1, max_tokens=8))
    drive_step(s, w)
    output = s.schedule()
    plan_of = wire_plan(output)
    plan_of.lora_loads.add(slot=1, name="intruder", path="/adapters/x")
    with pytest.raises(PlanError, match="reloaded"):
        w.execute(plan_of)


def test_slots_unit_rules() -> None:
    slots = LoraSlots(2)
    loads: list = []
    assert slots.board(0, "", "", loads) == 0 and not loads
    assert slots.can_board(5, loads)
    assert slots.board(5, "x", "/x", loads) == 1
    assert slots.board(6, "y", "/y", loads) == 2
    assert not slots.can_board(7, loads)     # both held
    slots.release(1)
    assert not slots.can_board(7, loads), "slot 1 was loaded in this step: not again"
    loads.clear()
    assert slots.can_board(7, loads) and slots.board(7, "z", "/z", loads) == 1
    with pytest.raises(AssertionError):
        slots.forget_loaded()


def test_an_adapter_request_without_slots_is_refused() -> None:
    s, _ = make(max_loras=0)
    with pytest.raises(ValueError, match="no slots"):
        s.add_request(lora_request(1, 1))

"""Scheduler policy, driven through a fake worker that executes real StepPlans."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.fake_worker import (FakeWorker, drive_step, make_request, reference_output,
                         run_until_idle, wire_plan)
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.plan import to_step_plan
from jitney.scheduler.core.request import FinishReason, Request, RequestStatus
from jitney.scheduler.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from jitney.worker.runner.plan_checks import PlanError as RealPlanError


def make(block_size: int = 4, num_blocks: int = 64, max_model_len: int = 64,
         max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
         policy: str = "continuous", eos: frozenset[int] = frozenset(),
         prefix_caching: bool = True) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks,
                             max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             policy=policy,  # type: ignore[arg-type]
                             enable_prefix_caching=prefix_caching)
    return Scheduler(config, eos_token_ids=eos), FakeWorker.for_config(config)


def chunk_of(output: SchedulerOutput, request: Request) -> ScheduledChunk | None:
    return next((c for c in output.scheduled if c.request is request), None)


def assert_reference(*requests: Request) -> None:
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.sampling.max_tokens)


# -- basics ------------------------------------------------------------------

def test_scheduling_code_imports_without_torch() -> None:
    code = ("import sys\n"
            "import jitney.scheduler.core.scheduler, jitney.scheduler.core.block_manager, jitney.scheduler.core.config, jitney.scheduler.core.plan\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fake_worker_runs_the_real_plan_checks_without_torch() -> None:
    """The fake worker checks plans with the real jitney.worker.runner.plan_checks, and that
    (like the fake) must stay importable without torch."""
    code = ("import sys\n"
            f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"   # the repository
            "import tests.support.fake_worker as fake_worker, jitney.worker.runner.plan_checks as plan\n"
            "assert fake_worker.validate_plan is plan.validate_plan\n"
            "assert fake_worker.PlanError is plan.PlanError\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def _break_block_id(plan: engine_pb2.StepPlan, w: FakeWorker) -> None:
    plan.chunks[0].new_block_ids[0] = w.limits.num_blocks


def _break_budget(plan: engine_pb2.StepPlan, w: FakeWorker) -> None:
    plan.chunks[0].token_ids.extend([1] * w.limits.max_num_batched_tokens)


def _break_context(plan: engine_pb2.StepPlan, w: FakeWorker) -> None:
    plan.chunks[0].start_position = w.limits.context_length


@pytest.mark.parametrize("corrupt, message", [
    (_break_block_id, "out of range"), (_break_budget, "max_num_batched_tokens"),
    (_break_context, "context length")])
def test_fake_worker_refuses_what_the_real_worker_refuses(
        corrupt: Callable[[engine_pb2.StepPlan, FakeWorker], None], message: str) -> None:
    s, w = make()
    s.add_request(make_request(1, 5))
    plan = wire_plan(s.schedule())
    corrupt(plan, w)
    with pytest.raises(RealPlanError, match=message):
        w.execute(plan)
    assert w.seqs == {} and w.holders == {}     # refused before anything was applied


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size"), ("num_blocks", -1, "num_blocks"),
    ("max_model_len", 0, "max_model_len"), ("max_num_seqs", 0, "max_num_seqs"),
    ("max_num_batched_tokens", 4, "max_num_batched_tokens"), ("policy", "fifo", "policy"),
    ("max_model_len", 1000, "KV cache holds"), ("block_size", 2.0, "block_size"),
    ("num_blocks", True, "num_blocks")])
def test_config_rejects_bad_values(field: str, value: object, message: str) -> None:
    kwargs: dict[str, object] = dict(block_size=4, num_blocks=16, max_model_len=64,
                                     max_num_seqs=8, max_num_batched_tokens=32)
    kwargs[field] = value
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_add_request_rejects_what_cannot_run() -> None:
    s, _ = make(max_model_len=16)
    s.add_request(make_request(1, 4))
    for bad in (make_request(1, 4), make_request(2, []), make_request(3, 17)):
        with pytest.raises(ValueError):
            s.add_request(bad)
    assert s.num_waiting == 1


def test_single_request_prefill_then_decode_and_plan_contents() -> None:
    s, w = make()
    r = make_request(7, 5, max_tokens=3, temperature=0.5, top_p=0.9, top_k=5, seed=11)
    s.add_request(r)
    out = s.schedule()
    plan = to_step_plan(out)
    assert out.step_id == plan.step_id == 1
    assert out.new_seqs == [r] and out.num_batched_tokens == 5
    (chunk,) = plan.chunks
    assert (chunk.seq_id, chunk.start_position, list(chunk.token_ids),
            list(chunk.new_block_ids), chunk.sample) == (7, 0, [1, 2, 3, 4, 5], [0, 1], True)
    (new,) = plan.new_sequences
    assert new.seq_id == 7 and new.sampling.top_k == 5 and new.sampling.seed == 11
    assert new.sampling.temperature == pytest.approx(0.5)
    assert new.sampling.top_p == pytest.approx(0.9)
    result = w.execute(plan)
    assert s.update_from_output(out, list(result.seq_ids), list(result.token_ids),
                                list(result.logprobs)) == [r]
    out, _ = drive_step(s, w)
    c = chunk_of(out, r)
    assert c is not None and (c.start_position, c.token_ids, c.new_block_ids, c.sample) \
        == (5, [r.output_token_ids[0]], [], True)
    assert out.new_seqs == [] and out.step_id == 2
    drive_step(s, w)
    assert r.finish_reason is FinishReason.LENGTH and r.is_finished
    assert_reference(r)
    assert len(r.output_logprobs) == 3
    assert s.get_request(7) is None and s.has_work()      # the free is pending
    out, _ = drive_step(s, w)
    assert out.freed_seq_ids == [7] and out.scheduled == [] and not out.is_empty
    assert not s.has_work() and w.seqs == {} and s.block_manager.num_used_blocks == 0
    assert s.schedule().is_empty


def test_update_rejects_a_result_that_does_not_match_the_plan() -> None:
    s, _ = make()
    s.add_request(make_request(1, 3))
    out = s.schedule()
    with pytest.raises(ValueError):
        s.update_from_output(out, [2], [5], [0.0])
    with pytest.raises(ValueError):
        s.update_from_output(out, [1], [5, 6], [0.0])


# -- budget, seats, chunking ---------------------------------------------------

def test_chunked_prefill_interleaves_with_decodes() -> None:
    s, w = make(max_num_seqs=4, max_num_batched_tokens=8)
    a = make_request(1, 2, max_tokens=20, ignore_eos=True)
    s.add_request(a)
    drive_step(s, w)
    b = make_request(2, 30, max_tokens=2)
    s.add_request(b)
    done = 0
    for _ in range(5):
        out, _ = drive_step(s, w)
        ca, cb = chunk_of(out, a), chunk_of(out, b)
        assert ca is not None and cb is not None and out.scheduled[0] is ca
        assert ca.num_new_tokens == 1 and ca.sample
        assert (cb.start_position, cb.num_new_tokens) == (done, min(7, 30 - done))
        done += cb.num_new_tokens
        assert cb.sample == (done == 30)
        assert cb.token_ids == list(range(1, 31))[cb.start_position:done]
    assert done == 30 and b.num_output_tokens == 1
    run_until_idle(s, w)
    assert_reference(a, b)


def test_budget_and_seats_hold_under_load() -> None:
    s, w = make(max_num_seqs=3, max_num_batched_tokens=10)
    requests = [make_request(i, 3 + 5 * i % 17, max_tokens=1 + i % 6, ignore_eos=True)
                for i in range(12)]
    for r in requests:
        s.add_request(r)
    outputs = run_until_idle(s, w)   # drive_step checks the limits every step
    assert max(len(o.scheduled) for o in outputs) == 3
    assert max(o.num_batched_tokens for o in outputs) == 10
    assert_reference(*requests)
    assert s.block_manager.num_used_blocks == 0 and w.seqs == {}


# -- preemption ----------------------------------------------------------------

def test_preemption_evicts_latest_arrival_and_resumes_identically() -> None:
    # Without the prefix cache b recomputes from 0 (see test_prefix_cache.py).
    s, w = make(block_size=2, num_blocks=4, max_model_len=8, max_num_seqs=2,
                max_num_batched_tokens=8, prefix_caching=False)
    a = make_request(1, 3, max_tokens=5, ignore_eos=True)
    b = make_request(2, 3, max_tokens=5, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    drive_step(s, w)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    drive_step(s, w)
    out, _ = drive_step(s, w)                  # a needs a block: b is evicted
    assert out.preempted == [b] and out.freed_seq_ids == [2]
    assert [c.request for c in out.scheduled] == [a] and a.block_ids == [0, 1, 3]
    assert (b.status, b.num_computed_tokens, b.block_ids, b.num_preemptions) \
        == (RequestStatus.WAITING, 0, [], 1)
    drive_step(s, w)                           # b does not fit yet
    assert s.num_waiting == 1
    drive_step(s, w)
    assert a.finish_reason is FinishReason.LENGTH
    out, _ = drive_step(s, w)                  # b resumes with a whole new table
    c = chunk_of(out, b)
    assert out.freed_seq_ids == [1] and out.new_seqs == [b] and c is not None
    assert (c.start_position, c.num_new_tokens, c.new_block_ids) == (0, 5, [2, 3, 1])
    assert c.token_ids == b.prompt_token_ids + b.output_token_ids[:2]
    run_until_idle(s, w)
    assert_reference(a, b)


def test_request_that_needs_the_block_may_be_the_victim() -> None:
    s, w = make(block_size=2, num_blocks=4, max_model_len=8, max_num_seqs=2,
                max_num_batched_tokens=8)
    a = make_request(1, 3, max_tokens=3, ignore_eos=True)
    b = make_request(2, 4, max_tokens=3, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    drive_step(s, w)
    out, _ = drive_step(s, w)                  # b's decode needs a block; b is last
    assert out.preempted == [b] and [c.request for c in out.scheduled] == [a]
    run_until_idle(s, w)
    assert_reference(a, b)


def test_victim_already_scheduled_this_step_is_taken_back() -> None:
    s, w = make(block_size=2, num_blocks=4, max_model_len=8, max_num_seqs=2,
                max_num_batched_tokens=4)
    low = make_request(1, 1, max_tokens=5, ignore_eos=True)
    s.add_request(low)
    drive_step(s, w)
    high = make_request(2, 6, max_tokens=2, priority=1, ignore_eos=True)
    s.add_request(high)
    drive_step(s, w)                           # low decodes, high prefills 3
    out, _ = drive_step(s, w)                  # low's decode first, then high needs a block
    assert out.preempted == [low] and out.freed_seq_ids == [1]
    assert [(c.request, c.num_new_tokens) for c in out.scheduled] == [(high, 3)]
    assert out.num_batched_tokens == 3
    run_until_idle(s, w)
    assert_reference(low, high)


def test_many_requests_in_a_tiny_cache_match_uncontended_runs() -> None:
    s, w = make(block_size=2, num_blocks=6, max_model_len=12, max_num_seqs=4,
                max_num_batched_tokens=6)
    requests = [make_request(i, 2 + i % 4, max_tokens=6, ignore_eos=True) for i in range(6)]
    for r in requests:
        s.add_request(r)
    outputs = run_until_idle(s, w)
    assert sum(r.num_preemptions for r in requests) > 0
    preempted = [r.seq_id for o in outputs for r in o.preempted]
    freed = [i for o in outputs for i in o.freed_seq_ids]
    assert set(preempted) <= set(freed)
    assert_reference(*requests)
    assert s.block_manager.num_used_blocks == 0 and w.seqs == {}


# -- abort, cancel, finish ----------------------------------------------------------

def test_abort_waiting_request_never_reaches_the_worker() -> None:
    s, w = make(max_num_seqs=1)
    a, b = make_request(1, 4), make_request(2, 4)
    s.add_request(a)
    s.add_request(b)
    drive_step(s, w)
    assert s.abort_request(2, FinishReason.CANCELLED) is b
    assert (b.status, b.finish_reason) == (RequestStatus.FINISHED, FinishReason.CANCELLED)
    assert s.abort_request(2, FinishReason.CANCELLED) is None
    assert s.abort_request(99, FinishReason.ABORTED) is None
    outputs = run_until_idle(s, w)
    assert 2 not in [i for o in outputs for i in o.freed_seq_ids]
    assert s.num_waiting == 0


def test_abort_running_request_frees_blocks_at_once() -> None:
    s, w = make()
    a, b = make_request(1, 9, max_tokens=8), make_request(2, 5, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    drive_step(s, w)
    assert s.block_manager.num_used_blocks == 5
    s.abort_request(1, FinishReason.CANCELLED)
    assert s.block_manager.num_used_blocks == 2 and s.num_running == 1
    out, _ = drive_step(s, w)
    assert out.freed_seq_ids == [1] and 1 not in w.seqs
    s.abort_request(2, FinishReason.ABORTED)
    assert s.block_manager.num_used_blocks == 0
    out, _ = drive_step(s, w)
    assert out.freed_seq_ids == [2] and w.seqs == {} and not s.has_work()


def test_abort_while_the_step_is_in_flight_ignores_its_token() -> None:
    s, w = make()
    a, b = make_request(1, 4), make_request(2, 4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.abort_request(1, FinishReason.CANCELLED)
    s.finish_request(2, FinishReason.STOP_SEQUENCE)
    assert s.block_manager.num_used_blocks == 0
    result = w.execute(to_step_plan(out))
    assert s.update_from_output(out, list(result.seq_ids), list(result.token_ids),
                                list(result.logprobs)) == []
    assert a.output_token_ids == [] and b.finish_reason is FinishReason.STOP_SEQUENCE
    out, _ = drive_step(s, w)
    assert out.freed_seq_ids == [1, 2] and w.seqs == {}


def test_abort_of_a_preempted_request_is_not_freed_twice() -> None:
    s, w = make(block_size=2, num_blocks=4, max_model_len=8, max_num_seqs=2,
                max_num_batched_tokens=8)
    a = make_request(1, 3, max_tokens=5, ignore_eos=True)
    b = make_request(2, 3, max_tokens=5, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        out, _ = drive_step(s, w)
    assert out.preempted == [b]
    s.abort_request(2, FinishReason.CANCELLED)
    outputs = run_until_idle(s, w)
    assert [i for o in outputs for i in o.freed_seq_ids] == [1]
    assert_reference(a)


def _first_repeat_free(tokens: list[int]) -> int:
    """An index i > 0 whose token does not occur before it."""
    return next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])


def test_finish_on_eos_stop_ids_and_ignore_eos() -> None:
    prompt = [5, 9, 2]
    ref = reference_output(prompt, 10)
    i = _first_repeat_free(ref)
    s, w = make(eos=frozenset({ref[i]}))
    eos = make_request(1, prompt, max_tokens=10)
    ignored = make_request(2, prompt, max_tokens=10, ignore_eos=True)
    stopped = make_request(3, prompt, max_tokens=10, ignore_eos=True,
                           stop_token_ids=frozenset({ref[i]}))
    for r in (eos, ignored, stopped):
        s.add_request(r)
    run_until_idle(s, w)
    assert eos.finish_reason is stopped.finish_reason is FinishReason.END_OF_SEQUENCE
    assert eos.output_token_ids == stopped.output_token_ids == ref[:i + 1]
    assert ignored.finish_reason is FinishReason.LENGTH and ignored.output_token_ids == ref


def test_finish_on_context_length() -> None:
    s, w = make(max_model_len=8, num_blocks=2)
    r = make_request(1, 5, max_tokens=10, ignore_eos=True)
    s.add_request(r)
    run_until_idle(s, w)
    assert r.finish_reason is FinishReason.CONTEXT_LENGTH
    assert r.num_tokens == 8 and r.num_output_tokens == 3


def test_finish_request_for_a_stop_string() -> None:
    s, w = make()
    r = make_request(1, 4, max_tokens=10)
    s.add_request(r)
    drive_step(s, w)
    assert s.finish_request(1, FinishReason.STOP_SEQUENCE) is r
    assert r.finish_reason is FinishReason.STOP_SEQUENCE and s.block_manager.num_used_blocks == 0
    out, _ = drive_step(s, w)
    assert out.freed_seq_ids == [1] and w.seqs == {}


# -- ordering and policies ------------------------------------------------------------

def _finish_order(s: Scheduler, w: FakeWorker) -> list[int]:
    order: list[int] = []
    while s.has_work():
        _, updated = drive_step(s, w)
        order += [r.seq_id for r in updated if r.is_finished]
    return order


def test_priority_then_arrival_then_seq_id() -> None:
    s, w = make(max_num_seqs=1)
    for seq_id, priority, arrival in [(1, 0, 0.0), (2, 2, 5.0), (3, 1, 3.0),
                                      (5, 1, 1.0), (4, 1, 1.0)]:
        s.add_request(make_request(seq_id, 3, max_tokens=2, priority=priority,
                                   arrival_time=arrival))
    assert _finish_order(s, w) == [2, 4, 5, 3, 1]


def test_static_batch_keeps_finished_seats_empty() -> None:
    s, w = make(max_num_seqs=3, policy="static")
    requests = [make_request(i, 4, max_tokens=m, ignore_eos=True)
                for i, m in enumerate([2, 5, 8, 3, 3], start=1)]
    for r in requests:
        s.add_request(r)
    running: list[int] = []
    while s.has_work():
        out, _ = drive_step(s, w)
        boarded = {r.seq_id for r in out.new_seqs}
        assert not boarded or running == [] or running[-1] == 0
        running.append(s.num_running)
    assert running[:8] == [3, 2, 2, 2, 1, 1, 1, 0]      # seats stay empty
    assert running[8] == 2                               # the next batch boards
    assert_reference(*requests)


def test_static_batch_boards_all_its_members_across_budget_limited_steps() -> None:
    """A batch is the head of the queue, all seats: prompts that do not fit
    the first step's budget board in later steps, and nobody else joins."""
    s, w = make(max_num_seqs=4, max_num_batched_tokens=8, policy="static")
    requests = [make_request(i, 6, max_tokens=3, ignore_eos=True) for i in range(1, 7)]
    for r in requests:
        s.add_request(r)
    riding: list[set[int]] = []
    while s.has_work():
        out, _ = drive_step(s, w)
        riding.append({c.request.seq_id for c in out.scheduled})
    assert max(len(r) for r in riding) == 4
    first_batch, second_batch = {1, 2, 3, 4}, {5, 6}
    assert all(r <= first_batch or r <= second_batch for r in riding)
    last_first = max(i for i, r in enumerate(riding) if r & first_batch)
    assert all(not (r & second_batch) for r in riding[: last_first + 1])
    assert_reference(*requests)


def test_sequential_runs_one_request_at_a_time_in_order() -> None:
    s, w = make(policy="sequential")
    for i in range(1, 5):
        s.add_request(make_request(i, 3 + i, max_tokens=3, ignore_eos=True))
    order: list[int] = []
    while s.has_work():
        out, updated = drive_step(s, w)
        assert len(out.scheduled) <= 1 and s.num_running <= 1
        order += [r.seq_id for r in updated if r.is_finished]
    assert order == [1, 2, 3, 4]


def test_boarding_is_fcfs_no_skipping_ahead() -> None:
    s, w = make(block_size=2, num_blocks=4, max_model_len=8, max_num_seqs=4)
    a = make_request(1, 5, max_tokens=2, ignore_eos=True)     # holds 3 blocks
    big, small = make_request(2, 6, max_tokens=1), make_request(3, 1, max_tokens=1)
    s.add_request(a)
    drive_step(s, w)
    s.add_request(big)
    s.add_request(small)
    drive_step(s, w)                  # small would fit in the last block
    assert small.status is RequestStatus.WAITING and s.num_running == 0
    run_until_idle(s, w)
    assert_reference(a, big, small)


def test_decodes_are_served_before_partial_prefills() -> None:
    s, w = make(max_num_seqs=2, max_num_batched_tokens=4)
    decoder = make_request(1, 2, max_tokens=8, ignore_eos=True)
    s.add_request(decoder)
    drive_step(s, w)
    prefill = make_request(2, 20, max_tokens=1)
    s.add_request(prefill)
    drive_step(s, w)
    s._running.reverse()              # the prefill now rides ahead of the decode
    out, _ = drive_step(s, w)
    assert [(c.request, c.num_new_tokens) for c in out.scheduled] == [(decoder, 1), (prefill, 3)]

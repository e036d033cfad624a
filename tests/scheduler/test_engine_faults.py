"""The Engine in-process against the fake worker: a failure in one request's
output handling ends that request only; deadlines free blocks; queue bounds;
priority reaches the scheduler."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jitney.engine.v1 import engine_pb2
from tests.support.engine_requests import LetterTokenizer, collect
from tests.support.fake_worker import FakeWorker, reference_output
from jitney.scheduler.core.admission import AdmissionLimits, QueueFullError
from jitney.scheduler.core.config import SchedulerConfig
from jitney.scheduler.core.engine import Engine, StreamEvent
from jitney.scheduler.core.request import SamplingOptions
from jitney.scheduler.core.request import ValidatedRequest
from jitney.scheduler.core.worker_link import StepDiscardedError, WorkerLinkError


class FakeLink:
    """Runs each plan on a FakeWorker, optionally slowly."""

    def __init__(self, worker: FakeWorker, step_seconds: float = 0.0) -> None:
        self.worker = worker
        self.step_seconds = step_seconds
        self.results: asyncio.Queue[engine_pb2.StepResult] = asyncio.Queue()

    async def send_plan(self, plan: engine_pb2.StepPlan) -> None:
        self.results.put_nowait(self.worker.execute(plan))

    async def receive_result(self, step_id: int) -> engine_pb2.StepResult:
        await asyncio.sleep(self.step_seconds)
        result = await self.results.get()
        assert result.step_id == step_id
        return result


def make_engine(step_seconds: float = 0.0, **admission: Any) -> Engine:
    config = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=200, max_num_seqs=4,
                             max_num_batched_tokens=32)
    link = FakeLink(FakeWorker(config.num_blocks, config.block_size), step_seconds)
    return Engine(config, link, LetterTokenizer(), frozenset(),  # type: ignore[arg-type]
                  admission=AdmissionLimits(**admission))


def request(prompt: list[int], max_tokens: int, priority: int = 0) -> ValidatedRequest:
    return ValidatedRequest(tuple(prompt), SamplingOptions(max_tokens=max_tokens, ignore_eos=True),
                            f"r{prompt[0]}", priority)


def test_a_failing_request_ends_alone_with_internal() -> None:
    async def main() -> None:
        engine = make_engine()
        loop = asyncio.create_task(engine.run())
        bad = engine.submit(request([5, 6, 7], 12))
        good = engine.submit(request([8, 9], 12))

        def explode(_ids: list[int]) -> None:
            raise RuntimeError("boom")
        bad.detokenizer.push = explode  # type: ignore[method-assign]
        bad_events, good_events = await asyncio.gather(collect(bad), collect(good))
        assert bad_events[-1].error_code == "INTERNAL"
        assert [t for e in good_events for t in e.token_ids] == reference_output([8, 9], 12)
        assert not loop.done()
        # The loop still serves new requests.
        more = await collect(engine.submit(request([3, 4], 5)))
        assert more[-1].finish_reason is not None
        assert engine.scheduler.block_manager.num_used_blocks == 0
        engine.close("done")
        loop.cancel()

    asyncio.run(main())


def test_deadline_ends_running_and_waiting_requests_and_frees_blocks() -> None:
    async def main() -> None:
        engine = make_engine(step_seconds=0.01, max_request_seconds=5.0)
        loop = asyncio.create_task(engine.run())
        running = engine.submit(request([5, 6], 150), time_remaining=0.15)
        events = await collect(running)
        assert events[-1].error_code == "DEADLINE_EXCEEDED"
        assert 0 < sum(len(e.token_ids) for e in events) < 150
        await asyncio.sleep(0.05)
        assert engine.scheduler.block_manager.num_used_blocks == 0
        assert engine.scheduler.num_running == 0
        engine.close("done")
        loop.cancel()

    asyncio.run(main())


def test_queue_bounds_and_priority_reach_the_scheduler() -> None:
    async def main() -> None:
        engine = make_engine(max_queued_requests=2, max_queued_tokens=50)
        first = engine.submit(request([1] * 30, 2, priority=7))     # the loop is not running:
        assert first.request.priority == 7                          # everything waits
        with pytest.raises(QueueFullError, match="max-queued-tokens"):
            engine.submit(request([2] * 21, 2))
        engine.submit(request([3] * 20, 2))
        with pytest.raises(QueueFullError, match="max-queued-requests"):
            engine.submit(request([4], 2))
        engine.close("done")

    asyncio.run(main())


# -- a failed step: its requests end INTERNAL, the step planned meanwhile is discarded ----

class FailingLink(FakeLink):
    """The worker loop's contract over a FakeWorker: step ``fail_step`` runs but
    is answered with a StepError (as if it failed after changing state); every
    later plan is discarded (StepError, discarded) until a reset plan. Records
    each plan, and checks the scheduler's invariants at every send."""

    def __init__(self, worker: FakeWorker, fail_step: int = 0) -> None:
        super().__init__(worker)
        self.fail_step = fail_step
        self.failed: int | None = None
        self.plans: dict[int, engine_pb2.StepPlan] = {}
        self.replies: asyncio.Queue[engine_pb2.StepResult | engine_pb2.StepError] = asyncio.Queue()
        self.engine: Engine | None = None
        self.resumed_with_output: list[int] = []   # seqs a reset plan boards that had streamed tokens
        self.discarded: list[int] = []

    async def send_plan(self, plan: engine_pb2.StepPlan) -> None:
        assert self.engine is not None
        self.engine.scheduler.check_invariants()
        self.plans[plan.step_id] = plan
        if self.failed is not None and not plan.reset:
            self.discarded.append(plan.step_id)
            self.replies.put_nowait(engine_pb2.StepError(step_id=plan.step_id, discarded=True))
            return
        if plan.reset:
            self.resumed_with_output += [n.seq_id for n in plan.new_sequences
                                         if self.engine.scheduler.get_request(n.seq_id).num_output_tokens]
        self.failed = None
        result = self.worker.execute(plan)
        if plan.step_id == self.fail_step:
            self.failed = plan.step_id
            self.replies.put_nowait(engine_pb2.StepError(step_id=plan.step_id, message="injected"))
        else:
            self.replies.put_nowait(result)

    async def receive_result(self, step_id: int) -> engine_pb2.StepResult:
        await asyncio.sleep(0)
        reply = await self.replies.get()
        assert reply.step_id == step_id
        if isinstance(reply, engine_pb2.StepError):
            error = StepDiscardedError if reply.discarded else WorkerLinkError
            raise error(f"step {step_id}: {reply.message}")
        return reply


RECOVERY_PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(20, 33)), [5, 3, 5, 8, 9, 7, 9], [2, 7]]
RECOVERY_MAX_TOKENS = [9, 14, 6, 11, 16]


async def run_with_failure(fail_step: int) -> tuple[FailingLink, Engine, list[list[StreamEvent]]]:
    """Five greedy requests on a cache small enough to preempt, step ``fail_step`` failing (0: none)."""
    config = SchedulerConfig(block_size=4, num_blocks=10, max_model_len=40, max_num_seqs=3,
                             max_num_batched_tokens=10)
    link = FailingLink(FakeWorker.for_config(config), fail_step)
    engine = Engine(config, link, LetterTokenizer(), frozenset())  # type: ignore[arg-type]
    link.engine = engine
    handles = [engine.submit(request(p, n)) for p, n in zip(RECOVERY_PROMPTS, RECOVERY_MAX_TOKENS)]
    loop = asyncio.create_task(engine.run())
    events = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 30)
    assert not loop.done()
    engine.scheduler.check_invariants()
    engine.close("done")
    loop.cancel()
    return link, engine, list(events)


def test_a_failed_step_ends_its_requests_only_and_the_overlapped_step_is_discarded() -> None:
    """Fail each step in turn: the requests with a chunk in it end INTERNAL
    (what they streamed is a prefix of their output); every other request
    ends exactly as with no fault, tokens never repeated or lost; no block
    leaks; the plan after the failure resets the worker."""
    link, engine, events = asyncio.run(run_with_failure(0))
    expected = [reference_output(p, n) for p, n in zip(RECOVERY_PROMPTS, RECOVERY_MAX_TOKENS)]
    assert [[t for e in ev for t in e.token_ids] for ev in events] == expected
    assert engine.num_preemptions > 0     # the cache is small enough to preempt
    steps = sorted(link.plans)
    seq_of = {i: i + 1 for i in range(len(RECOVERY_PROMPTS))}    # the engine numbers seqs 1, 2, ...
    bystanders_in_next, resumed = 0, 0
    for fail in steps:
        link, engine, events = asyncio.run(run_with_failure(fail))
        in_failed = {c.seq_id for c in link.plans[fail].chunks}
        for i, ev in enumerate(events):
            tokens = [t for e in ev for t in e.token_ids]
            if seq_of[i] in in_failed:
                assert ev[-1].error_code == "INTERNAL" and tokens == expected[i][:len(tokens)], (fail, i)
            else:
                assert ev[-1].finish_reason is not None and tokens == expected[i], (fail, i, ev[-1])
        assert engine.scheduler.block_manager.num_used_blocks == 0
        # At most the one plan in flight is discarded; the next plan resets the worker.
        later = sorted(s for s in link.plans if s > fail)
        assert len(link.discarded) <= 1 and link.discarded == later[:len(link.discarded)]
        assert [s for s in later if link.plans[s].reset] == later[len(link.discarded):][:1]
        bystanders_in_next += bool(link.discarded) and bool(
            {c.seq_id for c in link.plans[link.discarded[0]].chunks} - in_failed)
        resumed += len(link.resumed_with_output)
    assert bystanders_in_next and resumed, (bystanders_in_next, resumed)

"""The Engine in-process against the fake worker: a failure in one request's
output handling ends that request only; deadlines free blocks; queue bounds;
priority reaches the scheduler."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jitney.engine.v1 import engine_pb2
from fake_worker import FakeWorker, reference_output
from jitney.scheduler.admission import AdmissionLimits, QueueFullError
from jitney.scheduler.config import SchedulerConfig
from jitney.scheduler.engine import Engine, RequestHandle, StreamEvent
from jitney.scheduler.request import SamplingOptions
from jitney.scheduler.validation import ValidatedRequest


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


class Tokenizer:
    all_special_ids: list[int] = []

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def make_engine(step_seconds: float = 0.0, **admission: Any) -> Engine:
    config = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=200, max_num_seqs=4,
                             max_num_batched_tokens=32)
    link = FakeLink(FakeWorker(config.num_blocks, config.block_size), step_seconds)
    return Engine(config, link, Tokenizer(), frozenset(),  # type: ignore[arg-type]
                  admission=AdmissionLimits(**admission))


def request(prompt: list[int], max_tokens: int, priority: int = 0) -> ValidatedRequest:
    return ValidatedRequest(tuple(prompt), SamplingOptions(max_tokens=max_tokens, ignore_eos=True),
                            f"r{prompt[0]}", priority)


async def collect(handle: RequestHandle) -> list[StreamEvent]:
    return [event async for event in handle.stream()]


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

"""The scheduler's real WorkerLink on ipc sockets, with test sockets playing
the worker (tests/scheduler/test_worker_link.py, tests/e2e/test_shutdown.py):
``FakeWorkerSockets`` (the link and the fake workers' sockets), the frames a
worker sends, and ``run_on_link`` to run a test's coroutine against them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq.asyncio

from jitney.common.incarnation import new_incarnation
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.worker_link import WorkerLink
from tests.support.engine_sockets import WORKER_INCARNATION, WorkerSockets


def ready_frame(pid: int = 4242, incarnation: int = WORKER_INCARNATION) -> bytes:
    return engine_pb2.WorkerMessage(incarnation=incarnation, ready=engine_pb2.Ready(
        protocol_version=engine_pb2.PROTOCOL_VERSION_2, num_blocks=8, block_size=4,
        worker_pid=pid)).SerializeToString()


def heartbeat_frame(incarnation: int = WORKER_INCARNATION) -> bytes:
    return engine_pb2.WorkerMessage(incarnation=incarnation, heartbeat=engine_pb2.Heartbeat(
        worker_pid=1)).SerializeToString()


def result_frame(step_id: int, incarnation: int = WORKER_INCARNATION, token: int = 7) -> bytes:
    return engine_pb2.WorkerMessage(incarnation=incarnation, result=engine_pb2.StepResult(
        step_id=step_id, seq_ids=[1], token_ids=[token], logprobs=[-0.5])).SerializeToString()


class FakeWorkerSockets:
    """A link, and the sockets of one fake worker (more with ``another``)."""

    def __init__(self, tmp: Path) -> None:
        self.link = WorkerLink(f"ipc://{tmp}/plan", f"ipc://{tmp}/result", worker_timeout=0.6)
        self.ctx = zmq.asyncio.Context()
        self.workers = [WorkerSockets(self.ctx, self.link.plan_addr, self.link.result_addr)]
        self.pull = self.workers[0].plans     # (a DEALER)

    def another(self) -> WorkerSockets:
        worker = WorkerSockets(self.ctx, self.link.plan_addr, self.link.result_addr, new_incarnation())
        self.workers.append(worker)
        return worker

    async def send(self, frame: bytes) -> None:
        await self.workers[0].send(frame)

    async def serve_first(self) -> None:
        """The link serves the first fake worker (pid 0: nothing to kill)."""
        waiting = asyncio.ensure_future(self.link.wait_ready())
        await self.send(ready_frame(pid=0))
        await waiting

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.ctx.term()
        self.link.close()


def run_on_link(coro_fn: Callable[[FakeWorkerSockets], Awaitable[None]], tmp: Path) -> None:
    """``coro_fn(sockets)`` on a fresh link and fake worker in ``tmp``, within 10 s; both closed after."""
    async def main() -> None:
        sockets = FakeWorkerSockets(tmp)
        try:
            await asyncio.wait_for(coro_fn(sockets), 10)
        finally:
            sockets.close()
    asyncio.run(main())

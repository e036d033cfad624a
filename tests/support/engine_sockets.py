"""One end of the engine link's sockets, set up as the real process sets it
up (engine protocol 2), for tests that play the other process:

    WorkerSockets     a worker's DEALER (routing id = its incarnation) and PUSH,
                      connected to a WorkerLink; asyncio
    SchedulerSockets  the scheduler's ROUTER and PULL, bound, for a real worker
                      loop (a thread or a process); blocking

Every message sent goes out stamped with the incarnation.
"""

from __future__ import annotations

import time

import zmq
import zmq.asyncio

from jitney.common.incarnation import routing_id
from jitney.engine.v1 import engine_pb2

# A valid incarnation (top byte non-zero) for fake workers.
WORKER_INCARNATION = 0xA5_00_00_00_00_00_00_01


class WorkerSockets:
    """A fake worker's sockets on ``plan_addr`` / ``result_addr``."""

    def __init__(self, ctx: zmq.asyncio.Context, plan_addr: str, result_addr: str,
                 incarnation: int = WORKER_INCARNATION) -> None:
        self.incarnation = incarnation
        self.plans = ctx.socket(zmq.DEALER)
        self.push = ctx.socket(zmq.PUSH)
        self.plans.setsockopt(zmq.ROUTING_ID, routing_id(incarnation))
        for sock in (self.plans, self.push):
            sock.setsockopt(zmq.LINGER, 0)
        self.plans.connect(plan_addr)
        self.push.connect(result_addr)

    def frame(self, message: engine_pb2.WorkerMessage) -> bytes:
        message.incarnation = self.incarnation
        return message.SerializeToString()

    async def send(self, message: engine_pb2.WorkerMessage | bytes) -> None:
        """A message (stamped with this incarnation) or raw bytes (as they are)."""
        await self.push.send(message if isinstance(message, bytes) else self.frame(message))

    async def recv(self) -> engine_pb2.SchedulerMessage:
        return engine_pb2.SchedulerMessage.FromString(await self.plans.recv())

    def close(self) -> None:
        self.plans.close(0)
        self.push.close(0)


class SchedulerSockets:
    """The scheduler's sockets, bound; sends go to the worker whose Ready was read."""

    def __init__(self, plan_addr: str, result_addr: str, timeout_ms: int = 30_000) -> None:
        self.ctx = zmq.Context()
        self.plans = self.ctx.socket(zmq.ROUTER)
        self.results = self.ctx.socket(zmq.PULL)
        self.plans.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.results.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.plans.bind(plan_addr)
        self.results.bind(result_addr)
        self.incarnation = 0

    def ready(self) -> engine_pb2.Ready:
        """Wait for the worker's Ready; later sends go to its incarnation."""
        message = self.reply()
        assert message.HasField("ready"), message
        self.incarnation = message.incarnation
        return message.ready

    def send(self, message: engine_pb2.SchedulerMessage | None = None, *, raw: bytes | None = None,
             **fields: object) -> None:
        """``message`` or ``SchedulerMessage(**fields)``, stamped with the
        worker's incarnation; or ``raw`` bytes. Waits (up to 5 s) for the
        worker's route, which may come a moment after its Ready."""
        if raw is None:
            message = message or engine_pb2.SchedulerMessage(**fields)  # type: ignore[arg-type]
            message.incarnation = self.incarnation
            raw = message.SerializeToString()
        deadline = time.monotonic() + 5
        while True:
            try:
                self.plans.send_multipart([routing_id(self.incarnation), raw])
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def reply(self) -> engine_pb2.WorkerMessage:
        """The worker's next message that is not a heartbeat."""
        while True:
            message = engine_pb2.WorkerMessage.FromString(self.results.recv())
            if not message.HasField("heartbeat"):
                return message

    def close(self) -> None:
        self.plans.close(0)
        self.results.close(0)
        self.ctx.term()

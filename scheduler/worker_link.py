"""The scheduler's end of the ZeroMQ link to the worker.

The scheduler binds two sockets and the worker connects to both:

    plan_addr    PUSH (scheduler) -> PULL (worker)    SchedulerMessage
    result_addr  PULL (scheduler) <- PUSH (worker)    WorkerMessage

Each frame is one serialized protobuf message of the engine contract
(``protos/jitney/engine/v1``); nothing is ever pickled. A frame that does not
parse is logged and dropped, never acted on.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError

from client._generated.jitney.engine.v1 import engine_pb2

log = logging.getLogger("jitney.scheduler")


class WorkerLinkError(RuntimeError):
    """The worker sent something the scheduler cannot use."""


class WorkerLink:
    """Typed, async send/receive of engine messages."""

    def __init__(self, plan_addr: str, result_addr: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._plans = self._ctx.socket(zmq.PUSH)
        self._results = self._ctx.socket(zmq.PULL)
        for sock in (self._plans, self._results):
            sock.setsockopt(zmq.LINGER, 0)
        self._plans.bind(plan_addr)
        self._results.bind(result_addr)
        self.plan_addr = plan_addr
        self.result_addr = result_addr

    async def send_plan(self, plan: engine_pb2.StepPlan) -> None:
        msg = engine_pb2.SchedulerMessage(plan=plan)
        await self._plans.send(msg.SerializeToString(), copy=False)

    async def send_shutdown(self) -> None:
        msg = engine_pb2.SchedulerMessage(shutdown=engine_pb2.Shutdown())
        await self._plans.send(msg.SerializeToString())

    async def receive(self) -> engine_pb2.WorkerMessage:
        """The next well-formed worker message (malformed frames are dropped)."""
        while True:
            frame = await self._results.recv(copy=False)
            try:
                msg = engine_pb2.WorkerMessage.FromString(frame.bytes)
            except DecodeError as exc:
                log.error("dropped a malformed worker message (%d bytes): %s", len(frame.bytes), exc)
                continue
            if msg.WhichOneof("kind") is None:
                log.error("dropped a worker message with no content")
                continue
            return msg

    async def wait_ready(self) -> engine_pb2.Ready:
        """Wait for the worker's handshake and check its protocol version."""
        while True:
            msg = await self.receive()
            if msg.WhichOneof("kind") != "ready":
                log.warning("ignored %s before the worker's handshake", msg.WhichOneof("kind"))
                continue
            ready = msg.ready
            if ready.protocol_version != engine_pb2.PROTOCOL_VERSION_1:
                raise WorkerLinkError(
                    f"worker speaks engine protocol {ready.protocol_version}, "
                    f"this scheduler speaks {engine_pb2.PROTOCOL_VERSION_1}"
                )
            return ready

    async def step(self, plan: engine_pb2.StepPlan) -> engine_pb2.StepResult:
        """Send one plan and wait for its result."""
        await self.send_plan(plan)
        while True:
            msg = await self.receive()
            kind = msg.WhichOneof("kind")
            if kind == "result" and msg.result.step_id == plan.step_id:
                return msg.result
            if kind == "error" and msg.error.step_id == plan.step_id:
                raise WorkerLinkError(f"worker failed step {plan.step_id}: {msg.error.message}")
            log.warning("ignored an unexpected %s from the worker while waiting for step %d",
                        kind, plan.step_id)

    def close(self) -> None:
        self._plans.close(0)
        self._results.close(0)
        self._ctx.term()


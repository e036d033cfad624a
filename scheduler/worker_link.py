"""The scheduler's end of the ZeroMQ link to the worker.

The scheduler binds two sockets and the worker connects to both:

    plan_addr    PUSH (scheduler) -> PULL (worker)    SchedulerMessage
    result_addr  PULL (scheduler) <- PUSH (worker)    WorkerMessage

Each frame is one serialized protobuf message of the engine contract
(``protos/jitney/engine/v1``); nothing is ever pickled. A frame that does not
parse is logged and dropped, never acted on.

One task (the pump) reads every frame and keeps the link's view of the
worker:

    state       how it is entered                      receive()/send_plan()
    waiting     start; or after the worker was lost    raise WorkerLostError
    serving     wait_ready() returned a Ready           results and errors
    lost        no frame for ``worker_timeout`` s, or   raise WorkerLostError
                a new Ready while serving (restarted)

An idle worker sends a Heartbeat every second or so and a busy one answers
its step, so silence for ``worker_timeout`` means dead or hung. A worker lost
on this host (``ipc://``) is killed by pid, so that a hung one cannot come
back and answer a plan meant for its successor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError

from jitney.common.zmq_security import LinkServer, ServerKeys
from jitney.engine.v1 import engine_pb2

log = logging.getLogger("jitney.scheduler")

# Far above any real plan or result; a bigger frame is dropped by ZeroMQ
# before it is read into memory.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class WorkerLinkError(RuntimeError):
    """The worker sent something the scheduler cannot use (a failed step)."""


class WorkerLostError(RuntimeError):
    """The worker is dead, hung or was replaced; wait for a new Ready."""


class WorkerLink:
    """Typed, async send/receive of engine messages, with worker liveness."""

    def __init__(self, plan_addr: str, result_addr: str, *, worker_timeout: float = 30.0,
                 curve_keys: ServerKeys | None = None, insecure_plaintext: bool = False) -> None:
        self._ctx = zmq.asyncio.Context()
        # Curve server + allow-list (jitney.common.zmq_security); checks each endpoint.
        self._security = LinkServer(self._ctx, curve_keys, insecure_plaintext=insecure_plaintext)
        self._plans = self._ctx.socket(zmq.PUSH)
        self._results = self._ctx.socket(zmq.PULL)
        for sock in (self._plans, self._results):
            sock.setsockopt(zmq.LINGER, 0)
        self._plans.setsockopt(zmq.IMMEDIATE, 1)   # never queue a plan for no one
        self._results.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._security.prepare(self._plans, plan_addr)
        self._plans.bind(plan_addr)
        self._security.prepare(self._results, result_addr)
        self._results.bind(result_addr)
        self.plan_addr = plan_addr
        self.result_addr = result_addr
        self.worker_timeout = worker_timeout
        self.worker_pid = 0            # of the serving worker; 0 when none
        self.lost_reason = ""
        self._serving = False
        self._last_heard = 0.0
        self._inbox: asyncio.Queue[engine_pb2.WorkerMessage | None] = asyncio.Queue()
        self._readies: asyncio.Queue[engine_pb2.Ready] = asyncio.Queue()
        self._lost = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None

    @property
    def is_serving(self) -> bool:
        return self._serving

    async def wait_ready(self) -> engine_pb2.Ready:
        """Wait for a worker's handshake, check its protocol version, serve it."""
        if self._pump_task is None:
            self._pump_task = asyncio.create_task(self._pump())
        ready = await self._readies.get()
        if ready.protocol_version != engine_pb2.PROTOCOL_VERSION_1:
            raise WorkerLinkError(
                f"worker speaks engine protocol {ready.protocol_version}, "
                f"this scheduler speaks {engine_pb2.PROTOCOL_VERSION_1}")
        self._inbox = asyncio.Queue()        # nothing of an older worker survives
        self._lost.clear()
        self.lost_reason = ""
        self.worker_pid = ready.worker_pid
        self._last_heard = time.monotonic()
        self._serving = True
        return ready

    async def wait_lost(self) -> str:
        """Return (the reason) once the serving worker is lost."""
        await self._lost.wait()
        return self.lost_reason

    def declare_lost(self, reason: str) -> None:
        """Stop serving the current worker: every receive() now raises."""
        if not self._serving:
            return
        log.error("worker pid %d lost: %s", self.worker_pid, reason)
        self._serving = False
        self.lost_reason = reason
        self._kill_if_local(self.worker_pid)
        self.worker_pid = 0
        self._inbox.put_nowait(None)
        self._lost.set()

    async def send_plan(self, plan: engine_pb2.StepPlan) -> None:
        msg = engine_pb2.SchedulerMessage(plan=plan)
        await self._send(msg.SerializeToString())

    async def send_masks(self, masks: engine_pb2.StepMasks) -> None:
        msg = engine_pb2.SchedulerMessage(masks=masks)
        await self._send(msg.SerializeToString())

    async def send_shutdown(self) -> None:
        msg = engine_pb2.SchedulerMessage(shutdown=engine_pb2.Shutdown())
        try:
            await self._send(msg.SerializeToString())
        except WorkerLostError:
            pass    # nobody to tell

    async def receive(self) -> engine_pb2.WorkerMessage:
        """The serving worker's next result or error.

        Raises WorkerLostError once the worker is lost (and on every later
        call, until the next wait_ready()).
        """
        if not self._serving:
            raise WorkerLostError(self.lost_reason or "no worker is ready")
        msg = await self._inbox.get()
        if msg is None:
            self._inbox.put_nowait(None)     # for the next caller too
            raise WorkerLostError(self.lost_reason)
        return msg

    async def step(self, plan: engine_pb2.StepPlan) -> engine_pb2.StepResult:
        """Send one plan and wait for its result."""
        await self.send_plan(plan)
        return await self.receive_result(plan.step_id)

    async def receive_result(self, step_id: int) -> engine_pb2.StepResult:
        """Wait for the result of step ``step_id`` (plans run in order).

        Raises WorkerLinkError if the worker failed that step.
        """
        while True:
            msg = await self.receive()
            kind = msg.WhichOneof("kind")
            if kind == "result" and msg.result.step_id == step_id:
                return msg.result
            if kind == "error" and msg.error.step_id == step_id:
                raise WorkerLinkError(f"worker failed step {step_id}: {msg.error.message}")
            log.warning("ignored an unexpected %s from the worker while waiting for step %d",
                        kind, step_id)

    def close(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()
        self._plans.close(0)
        self._results.close(0)
        self._security.close()
        self._ctx.term()

    # -- internals ---------------------------------------------------------
    async def _send(self, frame: bytes) -> None:
        if not self._serving:
            raise WorkerLostError(self.lost_reason or "no worker is ready")
        try:
            # With IMMEDIATE set, a send waits while no worker is connected.
            await asyncio.wait_for(self._plans.send(frame, copy=False), self.worker_timeout)
        except asyncio.TimeoutError:
            self.declare_lost(f"could not hand it a plan for {self.worker_timeout:g} s")
            raise WorkerLostError(self.lost_reason) from None

    async def _pump(self) -> None:
        """Read every frame; watch the serving worker's silence."""
        while True:
            timeout_ms: int | None = None
            if self._serving:
                left = self._last_heard + self.worker_timeout - time.monotonic()
                if left <= 0:
                    self.declare_lost(f"no message for {self.worker_timeout:g} s (dead or hung)")
                    continue
                timeout_ms = int(left * 1000) + 1
            if not await self._results.poll(timeout_ms):  # POLLIN by default
                continue
            msg = parse_worker_message(await self._results.recv())
            if msg is not None:
                self._last_heard = time.monotonic()
                self._dispatch(msg)

    def _dispatch(self, msg: engine_pb2.WorkerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "heartbeat":
            return
        if kind == "ready":
            if self._serving:
                self.declare_lost(f"a new worker (pid {msg.ready.worker_pid}) sent Ready")
            self._readies.put_nowait(msg.ready)
        elif self._serving:
            self._inbox.put_nowait(msg)
        else:
            log.warning("dropped a %s from a worker that is not serving", kind)

    def _kill_if_local(self, pid: int) -> None:
        # Only on one host (ipc://): a pid from another machine means nothing here.
        if pid <= 0 or pid == os.getpid() or not self.plan_addr.startswith("ipc://"):
            return
        try:
            os.kill(pid, signal.SIGKILL)
            log.warning("killed the lost worker (pid %d); a new one must send Ready", pid)
        except (ProcessLookupError, PermissionError):
            pass


def parse_worker_message(frame: bytes) -> engine_pb2.WorkerMessage | None:
    """The message in ``frame``, or None (logged) if it is malformed."""
    try:
        msg = engine_pb2.WorkerMessage.FromString(frame)
    except DecodeError as exc:
        log.error("dropped a malformed worker message (%d bytes): %s", len(frame), exc)
        return None
    if msg.WhichOneof("kind") is None:
        log.error("dropped a worker message with no content (%d bytes)", len(frame))
        return None
    return msg

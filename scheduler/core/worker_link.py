"""The scheduler's end of the ZeroMQ link to the worker.

The scheduler binds two sockets and the worker connects to both:

    plan_addr    ROUTER (scheduler) -> DEALER (worker)   SchedulerMessage
    result_addr  PULL (scheduler) <- PUSH (worker)       WorkerMessage

Each frame is one serialized protobuf message of the engine contract
(``protos/jitney/engine/v1``); nothing is ever pickled. A frame that does not
parse is logged and dropped, never acted on.

Fencing: a worker has a random incarnation (``jitney.common.incarnation``),
on every WorkerMessage and as its DEALER's routing id. Every SchedulerMessage
goes through the ROUTER to the served incarnation only (a lost but still
connected worker gets none); any message but a Ready from another
incarnation is dropped, counted (``num_stale_frames``), logged once per
incarnation and answered with a Shutdown. See docs/architecture.md.

One task (the pump) reads every frame and keeps the link's view of the
worker:

    state       how it is entered                      receive()/send_plan()
    waiting     start; or after the worker was lost    raise WorkerLostError
                or told to shut down (its exit then
                is no loss, and logs none)
    serving     wait_ready() returned a Ready           results and errors
    lost        no frame for ``worker_timeout`` s, or   raise WorkerLostError
                a new Ready while serving (restarted)

An idle worker sends a Heartbeat every second or so and a busy one answers
its step, so silence for ``worker_timeout`` means dead or hung (only the
serving incarnation's frames count). A lost worker is sent a Shutdown; one
lost on this host (``ipc://``) is also killed by pid.
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
from zmq.utils.monitor import parse_monitor_message

from jitney.common.incarnation import is_valid, routing_id
from jitney.common.zmq_security import LinkServer, ServerKeys
from jitney.engine.v1 import engine_pb2

log = logging.getLogger("jitney.scheduler")

# Far above any real plan or result; a bigger frame is dropped by ZeroMQ
# before it is read into memory.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Longest pause between tries to hand the worker a message it has no route for yet.
MAX_SEND_PAUSE = 0.05


class WorkerLinkError(RuntimeError):
    """The worker sent something the scheduler cannot use (a failed step)."""


class StepDiscardedError(WorkerLinkError):
    """The worker discarded the step unrun: a step before it failed."""


class WorkerLostError(RuntimeError):
    """The worker is dead, hung or was replaced; wait for a new Ready."""


class WorkerLink:
    """Typed, async send/receive of engine messages, with worker liveness."""

    def __init__(self, plan_addr: str, result_addr: str, *, worker_timeout: float = 30.0,
                 curve_keys: ServerKeys | None = None, insecure_plaintext: bool = False) -> None:
        self._ctx = zmq.asyncio.Context()
        # Curve server + allow-list (jitney.common.zmq_security); checks each endpoint.
        self._security = LinkServer(self._ctx, curve_keys, insecure_plaintext=insecure_plaintext)
        # A plain socket: every send is tried at once (DONTWAIT), and retried from the loop.
        self._plans: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.ROUTER)
        self._results = self._ctx.socket(zmq.PULL)
        for sock in (self._plans, self._results):
            sock.setsockopt(zmq.LINGER, 0)
        self._plans.setsockopt(zmq.ROUTER_MANDATORY, 1)   # no route: an error, never a silent drop
        self._results.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._security.prepare(self._plans, plan_addr)
        self._plans.bind(plan_addr)
        self._security.prepare(self._results, result_addr)
        self._results.bind(result_addr)
        self.plan_addr = plan_addr
        self.result_addr = result_addr
        self.worker_timeout = worker_timeout
        self.worker_pid = 0            # of the serving worker; 0 when none
        self.incarnation = 0           # of the serving worker; 0 when none
        self.lost_reason = ""
        self.num_stale_frames = 0      # dropped: from an incarnation not served
        self._serving = False
        self._last_heard = 0.0
        self._inbox: asyncio.Queue[engine_pb2.WorkerMessage | None] = asyncio.Queue()
        self._readies: asyncio.Queue[tuple[int, engine_pb2.Ready]] = asyncio.Queue()
        self._arriving: set[int] = set()       # incarnations whose Ready wait_ready() has not taken
        self._stale_logged: set[int] = set()   # incarnations whose stale frames were logged
        self._lost = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None
        # Connections to the result socket, from its monitor: a worker that
        # exits closes its own, so the last one closing while a worker is
        # served means that worker is gone, now, not a --worker-timeout later.
        self._monitor = self._results.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.num_connections = 0
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def is_serving(self) -> bool:
        return self._serving

    async def wait_ready(self) -> engine_pb2.Ready:
        """Wait for a worker's handshake, check its protocol version, serve it.

        Of several queued Readies the latest wins (the others' workers are
        then stale: told to shut down when they next speak)."""
        if self._pump_task is None:
            self._pump_task = asyncio.create_task(self._pump())
            self._watch_task = asyncio.create_task(self._watch_connections())
        incarnation, ready = await self._readies.get()
        while not self._readies.empty():
            self._arriving.discard(incarnation)
            incarnation, ready = self._readies.get_nowait()
        self._arriving.discard(incarnation)
        if ready.protocol_version != engine_pb2.PROTOCOL_VERSION_2:
            raise WorkerLinkError(
                f"worker speaks engine protocol {ready.protocol_version}, "
                f"this scheduler speaks {engine_pb2.PROTOCOL_VERSION_2}")
        if not is_valid(incarnation):
            raise WorkerLinkError(f"worker pid {ready.worker_pid} sent a Ready without a valid "
                                  f"incarnation ({incarnation:#x})")
        self._inbox = asyncio.Queue()        # nothing of an older worker survives
        self._lost.clear()
        self.lost_reason = ""
        self.worker_pid = ready.worker_pid
        self.incarnation = incarnation
        self._last_heard = time.monotonic()
        self._serving = True
        log.info("serving worker pid %d, incarnation %016x", ready.worker_pid, incarnation)
        return ready

    async def wait_lost(self) -> str:
        """Return (the reason) once the serving worker is lost."""
        await self._lost.wait()
        return self.lost_reason

    def declare_lost(self, reason: str) -> None:
        """Stop serving the current worker: every receive() now raises. It is
        told to shut down (should it be alive after all) and, on this host,
        killed."""
        if not self._serving:
            return
        log.error("worker pid %d (incarnation %016x) lost: %s", self.worker_pid, self.incarnation, reason)
        self._post_shutdown(self.incarnation)
        self._kill_if_local(self.worker_pid)
        self._stop_serving(reason)

    async def send_plan(self, plan: engine_pb2.StepPlan) -> None:
        await self._send(engine_pb2.SchedulerMessage(plan=plan))

    async def send_masks(self, masks: engine_pb2.StepMasks) -> None:
        await self._send(engine_pb2.SchedulerMessage(masks=masks))

    async def send_shutdown(self) -> None:
        """Tell the serving worker to exit, and stop serving it: the exit that
        follows (its connection closing) is the end asked for, not a loss."""
        try:
            await self._send(engine_pb2.SchedulerMessage(shutdown=engine_pb2.Shutdown()))
        except WorkerLostError:
            return    # nobody to tell
        log.info("told worker pid %d (incarnation %016x) to shut down", self.worker_pid, self.incarnation)
        self._stale_logged.add(self.incarnation)   # a heartbeat it sends before it reads the Shutdown: no warning
        self._stop_serving("it was told to shut down")

    def _stop_serving(self, reason: str) -> None:
        self._serving = False
        self.lost_reason = reason
        self.worker_pid = 0
        self.incarnation = 0
        self._inbox.put_nowait(None)
        self._lost.set()

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

        Raises WorkerLinkError if the worker failed that step,
        StepDiscardedError (a WorkerLinkError) if it discarded it.
        """
        while True:
            msg = await self.receive()
            kind = msg.WhichOneof("kind")
            if kind == "result" and msg.result.step_id == step_id:
                return msg.result
            if kind == "error" and msg.error.step_id == step_id:
                error = StepDiscardedError if msg.error.discarded else WorkerLinkError
                raise error(f"worker failed step {step_id}: {msg.error.message}")
            log.warning("ignored an unexpected %s from the worker while waiting for step %d",
                        kind, step_id)

    def close(self) -> None:
        for task in (self._pump_task, self._watch_task):
            if task is not None:
                task.cancel()
        self._results.disable_monitor()
        self._monitor.close(0)
        self._plans.close(0)
        self._results.close(0)
        self._security.close()
        self._ctx.term()

    # -- internals ---------------------------------------------------------
    async def _send(self, message: engine_pb2.SchedulerMessage) -> None:
        """Hand ``message`` to the serving incarnation. Its route may come a
        moment after its Ready (the worker's two sockets connect on their
        own): retried until ``worker_timeout``, then the worker is lost."""
        if not self._serving:
            raise WorkerLostError(self.lost_reason or "no worker is ready")
        incarnation = message.incarnation = self.incarnation
        frames = [routing_id(incarnation), message.SerializeToString()]
        deadline = time.monotonic() + self.worker_timeout
        pause = 0.001
        while True:
            if not self._serving or self.incarnation != incarnation:
                raise WorkerLostError(self.lost_reason or "the worker was replaced")
            if self._post(frames):
                return
            if time.monotonic() >= deadline:
                self.declare_lost(f"could not hand it a message for {self.worker_timeout:g} s "
                                  "(not connected, or its queue is full)")
                raise WorkerLostError(self.lost_reason)
            await asyncio.sleep(pause)
            pause = min(2 * pause, MAX_SEND_PAUSE)

    def _post(self, frames: list[bytes]) -> bool:
        """Send now, without waiting; False if the route is unknown or full."""
        try:
            self._plans.send_multipart(frames, flags=zmq.DONTWAIT)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def _post_shutdown(self, incarnation: int) -> None:
        """Tell a worker that is not (or no longer) served to exit, if it is connected."""
        if incarnation:
            message = engine_pb2.SchedulerMessage(shutdown=engine_pb2.Shutdown(), incarnation=incarnation)
            self._post([routing_id(incarnation), message.SerializeToString()])

    async def _pump(self) -> None:
        """Read every frame; watch the serving worker's silence."""
        while True:
            # Not serving: wake now and then anyway, as a worker may be served
            # (wait_ready) while this waits, and then fall silent at once.
            timeout_ms = int(self.worker_timeout * 1000) + 1
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
                self._dispatch(msg)

    async def _watch_connections(self) -> None:
        """Count the result socket's connections; the last one closing while a
        worker is served loses it at once (killed, crashed, its host gone).
        A worker that stays connected but hangs is caught by the silence
        timeout instead, and a new worker's Ready replaces a lost one whose
        connection is not closed yet."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.num_connections += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.num_connections = max(0, self.num_connections - 1)
                if self.num_connections == 0:
                    self.declare_lost("its connection closed (the process exited or its host went away)")

    def _dispatch(self, msg: engine_pb2.WorkerMessage) -> None:
        kind = msg.WhichOneof("kind")
        incarnation = msg.incarnation
        if kind == "ready":
            if self._serving:
                self.declare_lost(f"a new worker (pid {msg.ready.worker_pid}) sent Ready")
            self._arriving.add(incarnation)
            self._readies.put_nowait((incarnation, msg.ready))
        elif self._serving and incarnation == self.incarnation:
            self._last_heard = time.monotonic()
            if kind != "heartbeat":
                self._inbox.put_nowait(msg)
        elif incarnation not in self._arriving:   # (an arriving worker's heartbeats wait with it)
            self._drop_stale(incarnation, kind)

    def _drop_stale(self, incarnation: int, kind: str | None) -> None:
        """A frame of a worker that is not served: dropped, counted; the worker is told to exit."""
        self.num_stale_frames += 1
        if incarnation not in self._stale_logged:
            self._stale_logged.add(incarnation)
            log.warning("dropping the messages of worker incarnation %016x, which is not served "
                        "(the first: a %s); telling it to shut down", incarnation, kind)
        self._post_shutdown(incarnation)

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

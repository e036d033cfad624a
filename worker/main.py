"""The worker process: receive step plans over ZeroMQ, send results back.

Wire protocol (protos/jitney/engine/v1/engine.proto): the worker draws a
random incarnation, connects a DEALER socket whose routing id is that
incarnation to ``plan_addr`` (the scheduler's ROUTER) and a PUSH socket to
``result_addr``; it sends ``WorkerMessage(ready)`` once the model and cache
are up, then answers each ``SchedulerMessage(plan)`` with a ``StepResult`` or
a ``StepError``, until ``Shutdown`` or SIGTERM (below). Every message it sends carries
its incarnation; a message for another incarnation is dropped. Messages are
protobuf bytes, never pickle.

    after              plans are
    Ready, a result    run
    a StepError        discarded (StepError, discarded = true; not run, no
                       state changed) until a plan with reset = true, which
                       forgets every sequence and then runs

A plan with masked chunks waits, after its forward, for the ``StepMasks`` of
its step on the same socket: plans that arrive meanwhile are queued and run
after it, in order; a Shutdown ends the worker; masks of a step that never
waited for them (its plan was refused, discarded or failed first) are dropped.

The watchdog (``--hang-timeout``, ``watchdog.py``) is re-armed before every
step and every wait for a message: a worker stuck longer exits.

SIGTERM: a worker run alone (`jitney worker`) exits 0 on it. One started by
`jitney serve` (``SUPERVISOR_FD_ENV`` set; the standby and every
tensor-parallel rank too) ignores it while its supervisor holds the pipe
named there: a SIGTERM sent to the whole process group reaches the worker
as well as the scheduler, and the scheduler's drain needs the worker until
it sends Shutdown. Once the supervisor has closed that pipe (it lets the
worker go) or is gone, SIGTERM ends the worker again.

Tensor parallelism (``--tp-size N``, ``parallel.py``): every rank joins the
group first. Rank 0 runs this loop; its runner relays each plan it runs to
the other ranks, and it relays its heartbeats and a Shutdown too. The other
ranks connect no socket and run ``parallel.follow``. Under a group, a step
that fails with anything but a refused plan or unfitting masks ends the
process (its collectives may be out of step with the other ranks'): the
group goes down, and is restarted whole.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Protocol

import zmq
from google.protobuf.message import DecodeError

from jitney.common.background import idle_priority
from jitney.common.incarnation import new_incarnation, routing_id
from jitney.common.supervision import (MAX_REFUSAL_BYTES, READY_FD_ENV, REFUSED_BYTE, REFUSED_EXIT_CODE,
                                      STANDBY_FD_ENV, SUPERVISOR_FD_ENV, pipe_ended)
from jitney.common.zmq_security import client_side, load_client_keys
from jitney.engine.v1 import engine_pb2
from jitney.worker.distributed import parallel
from jitney.worker.config import WorkerConfig, add_parallel_arguments, add_worker_arguments
from jitney.worker.models.config import UnsupportedModelError
from jitney.worker.runner.plan_checks import PlanError
from jitney.worker.runner.model_runner import MaskError, MaskSource, ModelRunner
from jitney.worker.runner.watchdog import Watchdog

logger = logging.getLogger("jitney.worker")

# Plans arrive one step at a time; a small queue bounds memory if the
# scheduler runs ahead, without ever blocking a normal exchange.
SOCKET_HWM = 64
# An idle worker says it is alive this often; the scheduler declares a
# worker silent for its --worker-timeout (default 30 s) lost.
HEARTBEAT_SECONDS = 1.0
# Far above any real plan; a bigger frame is dropped before it is read.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Runner(Protocol):
    """What the loop needs of a ``ModelRunner`` (tests give it fakes)."""

    def ready_message(self) -> engine_pb2.Ready: ...

    def execute(self, plan: engine_pb2.StepPlan,
                wait_for_masks: MaskSource | None = None) -> engine_pb2.StepResult: ...


class _Terminated(BaseException):
    """Raised from the SIGTERM handler to unwind the loop cleanly. Not an
    Exception: it may come out of any line of the model's load, and code
    there that handles its own failures (``except Exception``: a weights
    cache entry it would then drop as damaged) must not take it for one."""


class _ShutdownRequested(Exception):
    """A Shutdown arrived while a step waited for its masks: unwinds the step, then the loop."""


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises ``_Terminated`` inside the block; under `jitney serve`
    only once the supervisor has let go (module docstring)."""
    # signal handlers can only be set from the main thread (tests may run the
    # loop in another one; there, SIGTERM keeps its default meaning).
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    lifeline = _supervisor_pipe()
    ignored = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal ignored
        if lifeline is None or pipe_ended(lifeline):
            raise _Terminated()
        if not ignored:     # a group SIGTERM: the scheduler drains and then sends Shutdown
            ignored = True
            logger.info("SIGTERM ignored: `jitney serve` supervises this worker, which serves "
                        "the scheduler's drain and exits on its Shutdown")

    previous = signal.signal(signal.SIGTERM, handler)
    # The supervisor starts this process with SIGTERM blocked (jitney.common.supervision):
    # one that came before this handler was set is delivered to it now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _supervisor_pipe() -> int | None:
    """The read end of the supervisor's pipe (``SUPERVISOR_FD_ENV``), None when run alone.
    Left open for the process's life: its end is how the supervisor lets go."""
    fd = os.environ.pop(SUPERVISOR_FD_ENV, None)
    if fd is None:
        return None
    try:
        os.fstat(int(fd))
    except (OSError, ValueError) as err:
        logger.warning("%s=%s is not an open pipe (%s): SIGTERM ends this worker", SUPERVISOR_FD_ENV, fd, err)
        return None
    return int(fd)


def run_worker(config: WorkerConfig, make_runner: Callable[[WorkerConfig], Runner] = ModelRunner) -> int:
    """Serve plans until Shutdown (exit code 0) or SIGTERM (also 0; see the module docstring).
    A model no code path runs (``UnsupportedModelError`` while loading) exits
    ``REFUSED_EXIT_CODE``, telling a supervisor why: restarting cannot help.

    Under tensor parallelism the group is joined first and the runner is
    always a ``ModelRunner`` of it; a rank > 0 follows rank 0 instead."""
    try:
        with _sigterm_exits():      # the group's rendezvous too: it may wait for minutes
            group = parallel.init_group(config)
            if group is not None and group.rank > 0:
                return _follow(config, group)
            return _lead(config, make_runner, group)
    except _Terminated:
        logger.info("SIGTERM: exiting")
        return 0
    except UnsupportedModelError as err:
        logger.error("cannot serve this model: %s", err)
        _tell_supervisor_refused(str(err))
        return REFUSED_EXIT_CODE


def _lead(config: WorkerConfig, make_runner: Callable[[WorkerConfig], Runner],
          group: parallel.TensorParallelGroup | None) -> int:
    """The worker the scheduler sees (alone, or rank 0 of a group): load, connect, serve."""
    if config.plan_addr is None or config.result_addr is None:
        raise ValueError("plan_addr and result_addr must be set")
    keys = load_client_keys(config.curve_keys) if config.curve_keys else None
    incarnation = new_incarnation()
    context = zmq.Context()
    plans = context.socket(zmq.DEALER)
    push = context.socket(zmq.PUSH)
    watchdog = Watchdog(config.hang_timeout)
    try:
        for sock, hwm in ((plans, zmq.RCVHWM), (push, zmq.SNDHWM)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(hwm, SOCKET_HWM)
        plans.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        plans.setsockopt(zmq.ROUTING_ID, routing_id(incarnation))   # the scheduler addresses us by it
        with _standby_in_background() as idle:
            runner = make_runner(config) if group is None else ModelRunner(config, group=group)
        if STANDBY_FD_ENV in os.environ:
            logger.info("standby: loaded at idle CPU priority (SCHED_IDLE), now back at the normal one" if idle
                        else "standby: loaded at the normal CPU priority (this process may not come back from "
                             "SCHED_IDLE: no CAP_SYS_NICE, RLIMIT_NICE < 20)")
        if not _standby_until_activated():
            return 0
        client_side(plans, config.plan_addr, keys, insecure_plaintext=config.insecure_plaintext_zmq)
        plans.connect(config.plan_addr)
        client_side(push, config.result_addr, keys, insecure_plaintext=config.insecure_plaintext_zmq)
        push.connect(config.result_addr)
        outbox = _Outbox(push, incarnation)
        outbox.send(engine_pb2.WorkerMessage(ready=runner.ready_message()))
        logger.info("ready (incarnation %016x): plans from %s, results to %s",
                    incarnation, config.plan_addr, config.result_addr)
        _tell_supervisor_ready()
        return _serve(runner, _Inbox(plans, outbox, watchdog, group), watchdog)
    finally:
        watchdog.disarm()
        plans.close(linger=0)
        push.close(linger=0)
        context.term()


def _follow(config: WorkerConfig, group: parallel.TensorParallelGroup) -> int:
    """A rank > 0: load its shard, then run what rank 0 relays until its Shutdown or SIGTERM."""
    os.environ.pop(READY_FD_ENV, None)   # rank 0 alone tells the supervisor the group is ready
    watchdog = Watchdog(config.hang_timeout)
    try:
        runner = ModelRunner(config, group=group)
        logger.info("rank %d of %d: following rank 0", group.rank, group.size)
        code = parallel.follow(runner, group, watchdog)
        group.close()
        return code
    finally:
        watchdog.disarm()


class _Outbox:
    """The PUSH socket: every message goes out stamped with this worker's incarnation."""

    def __init__(self, push: zmq.Socket, incarnation: int) -> None:  # type: ignore[type-arg]
        self.push, self.incarnation = push, incarnation

    def send(self, message: engine_pb2.WorkerMessage) -> None:
        message.incarnation = self.incarnation
        self.push.send(message.SerializeToString())

    def send_error(self, step_id: int, message: str) -> None:
        self.send(_error(step_id, message))


class _Inbox:
    """The plan socket, and the plans that arrived while a step waited for its masks."""

    def __init__(self, plans: zmq.Socket, outbox: _Outbox, watchdog: Watchdog,  # type: ignore[type-arg]
                 group: parallel.TensorParallelGroup | None = None) -> None:
        self.plans, self.outbox, self.watchdog = plans, outbox, watchdog
        self.group = group   # rank 0 of a tensor-parallel group: heartbeats and Shutdown are relayed
        self.queued: deque[tuple[engine_pb2.StepPlan, float]] = deque()   # (plan, time received)
        # Steps that ended without reading their masks: those masks are dropped when they come.
        self.unread_masks: set[int] = set()
        self.masks_read: int | None = None   # step id of the last masks handed to a step
        self.heartbeat = engine_pb2.WorkerMessage(heartbeat=engine_pb2.Heartbeat(worker_pid=os.getpid()))

    def receive(self) -> tuple[engine_pb2.SchedulerMessage, float] | None:
        """The next message for this incarnation and when it came; None after a
        heartbeat's silence (a heartbeat is sent), an undecodable frame
        (answered with an error) or a message for another incarnation (dropped)."""
        self.watchdog.arm()
        if not self.plans.poll(int(HEARTBEAT_SECONDS * 1000)):
            self.outbox.send(self.heartbeat)
            if self.group is not None:
                self.group.heartbeat()
            return None
        data = self.plans.recv()
        received = time.perf_counter()
        try:
            message = engine_pb2.SchedulerMessage.FromString(data)
        except DecodeError as err:
            self.outbox.send_error(0, f"undecodable scheduler message: {err}")
            return None
        if message.incarnation != self.outbox.incarnation:
            logger.warning("dropped a message for incarnation %016x (this worker is %016x)",
                           message.incarnation, self.outbox.incarnation)
            return None
        return message, received

    def next(self) -> tuple[engine_pb2.SchedulerMessage, str, float]:
        """The next message of a known kind, its kind and when it came (heartbeats
        sent while none comes; a message of no known kind is answered with an error)."""
        while True:
            got = self.receive()
            if got is None:
                continue
            message, received = got
            kind = message.WhichOneof("kind")
            if kind in ("plan", "shutdown", "masks"):
                return message, kind, received
            self.outbox.send_error(0, f"scheduler message without a known kind ({kind})")

    def wait_for_masks(self, step_id: int) -> engine_pb2.StepMasks:
        """The next masks a step can use (``runner.MaskSource``; the runner checks
        their step id). Plans are queued meanwhile; a Shutdown raises ``_ShutdownRequested``."""
        while True:
            message, kind, received = self.next()
            if kind == "plan":
                self.queued.append((message.plan, received))
            elif kind == "shutdown":
                raise _ShutdownRequested()
            elif message.masks.step_id in self.unread_masks:
                self.unread_masks.discard(message.masks.step_id)   # stale: its step is over
            else:
                self.masks_read = message.masks.step_id
                return message.masks

    def drop_masks(self, masks: engine_pb2.StepMasks) -> None:
        """Masks that came while no step waited for any."""
        if masks.step_id in self.unread_masks:
            self.unread_masks.discard(masks.step_id)
        else:
            logger.warning("masks for step %d, which does not wait for any: dropped", masks.step_id)


def _serve(runner: Runner, inbox: _Inbox, watchdog: Watchdog) -> int:
    failed: int | None = None   # the step that failed; later plans are discarded until a reset
    while True:
        if inbox.queued:
            plan, received = inbox.queued.popleft()
        else:
            message, kind, received = inbox.next()
            if kind == "shutdown":
                logger.info("shutdown requested")
                _relay_shutdown(inbox)
                return 0
            if kind == "masks":
                inbox.drop_masks(message.masks)
                continue
            plan = message.plan
        inbox.masks_read = None
        if failed is not None and not plan.reset:
            reply = _discarded(plan.step_id, failed)
        else:
            if plan.reset:   # every message from before it was read: no masks still to come
                inbox.unread_masks.clear()
            watchdog.arm()
            try:
                reply = _execute(runner, plan, inbox.wait_for_masks, fatal=inbox.group is not None)
            except _ShutdownRequested:
                logger.info("shutdown requested while step %d waited for its masks", plan.step_id)
                _relay_shutdown(inbox)
                return 0
            failed = plan.step_id if reply.HasField("error") else None
        if any(c.masked for c in plan.chunks) and inbox.masks_read != plan.step_id:
            inbox.unread_masks.add(plan.step_id)   # refused, discarded, or failed before its masks were read
        if reply.HasField("result"):
            reply.result.worker_seconds = time.perf_counter() - received
        inbox.outbox.send(reply)


def _relay_shutdown(inbox: _Inbox) -> None:
    if inbox.group is not None:
        inbox.group.shutdown()
        inbox.group.close()


def _execute(runner: Runner, plan: engine_pb2.StepPlan,
             wait_for_masks: Callable[[int], engine_pb2.StepMasks] | None = None,
             fatal: bool = False) -> engine_pb2.WorkerMessage:
    """The reply to ``plan``. ``fatal`` (a tensor-parallel rank 0): an error other
    than a refused plan or unfitting masks is raised, not answered."""
    try:
        return engine_pb2.WorkerMessage(result=runner.execute(plan, wait_for_masks))
    except PlanError as err:
        return _error(plan.step_id, f"bad plan: {err}")
    except MaskError as err:
        return _error(plan.step_id, f"bad masks: {err}")
    except (_Terminated, _ShutdownRequested):
        raise
    except Exception as err:  # a worker bug: report it, keep serving
        logger.exception("step %d failed", plan.step_id)
        if fatal:
            raise
        return _error(plan.step_id, f"step failed: {type(err).__name__}: {err}")


def _error(step_id: int, message: str) -> engine_pb2.WorkerMessage:
    logger.error("step %d: %s", step_id, message)
    return engine_pb2.WorkerMessage(error=engine_pb2.StepError(step_id=step_id, message=message))


def _discarded(step_id: int, failed: int) -> engine_pb2.WorkerMessage:
    """The answer to a plan made before the scheduler knew that step ``failed`` failed."""
    message = f"discarded: step {failed} failed, and no reset plan came since"
    logger.warning("step %d %s", step_id, message)
    return engine_pb2.WorkerMessage(error=engine_pb2.StepError(step_id=step_id, message=message, discarded=True))


def _standby_in_background() -> contextlib.AbstractContextManager[bool]:
    """A standby loads at idle CPU priority where it may come back to the normal
    one (``jitney.common.background``); the serving worker at the normal one."""
    if STANDBY_FD_ENV not in os.environ:
        return contextlib.nullcontext(False)
    return idle_priority()


def _standby_until_activated() -> bool:
    """A standby worker (``JITNEY_STANDBY_FD`` set by `jitney serve`'s
    supervisor) waits, loaded and warm, for one byte on that pipe before it
    connects; False when the pipe ends instead (the supervisor is stopping)."""
    fd = os.environ.pop(STANDBY_FD_ENV, None)
    if fd is None:
        return True
    logger.info("standby: loaded and warm; waiting to take over")
    try:
        got = os.read(int(fd), 1)
    finally:
        os.close(int(fd))
    if got != b"g":
        logger.info("standby: the supervisor is gone; exiting")
        return False
    logger.info("standby: taking over")
    return True


def _tell_supervisor_ready() -> None:
    """Under `jitney serve`: one byte on the pipe the supervisor gave
    (``JITNEY_READY_FD``), so it knows this worker came up (its restart policy
    tells a worker that died serving from one that cannot start)."""
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is None:
        return
    try:
        os.write(int(fd), b"r")
        os.close(int(fd))
    except (OSError, ValueError) as err:
        logger.warning("could not tell the supervisor this worker is ready (%s=%s): %s", READY_FD_ENV, fd, err)


def _tell_supervisor_refused(reason: str) -> None:
    """Under `jitney serve`: the refusal byte and the reason on the ready pipe, in one write."""
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is None:
        return
    data = REFUSED_BYTE + reason.encode()[:MAX_REFUSAL_BYTES]
    try:
        os.write(int(fd), data)
        os.close(int(fd))
    except (OSError, ValueError) as err:
        logger.warning("could not tell the supervisor this worker refused its model (%s=%s): %s",
                       READY_FD_ENV, fd, err)


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.main --plan-addr ... --result-addr ...``."""
    parser = argparse.ArgumentParser(prog="python -m worker.main", description="Jitney worker process")
    add_worker_arguments(parser)
    add_parallel_arguments(parser)
    ns = parser.parse_args(argv)
    if ns.tp_rank == 0 and (ns.plan_addr is None or ns.result_addr is None):
        parser.error("--plan-addr and --result-addr are required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_worker(WorkerConfig.from_namespace(ns))


if __name__ == "__main__":
    sys.exit(main())

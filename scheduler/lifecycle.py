"""The scheduler process's life with its workers: serve, lose, re-sync, drain.

    wait for Ready ──► serving ──(worker lost)──► every in-flight request ends
         ▲               │                        UNAVAILABLE, health NOT_SERVING,
         └───────────────┼────────────────────────  the Engine is dropped
                         │ SIGTERM: drain          (a new Ready brings a new
                         ▼                          Engine for its geometry)
      NOT_SERVING, new requests UNAVAILABLE, running ones finish within
      --drain-seconds (then UNAVAILABLE), Shutdown to the worker, exit 0

The Engine of one worker never outlives it: the worker's KV cache is gone
with it, so a new worker gets a new Scheduler (block manager, sequence ids)
built from the geometry in its Ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1 import health_pb2

from jitney.common.arg_types import int_in, non_negative_float, positive_float, positive_int
from jitney.common.lora_adapter import AdapterError
from jitney.engine.v1 import engine_pb2
from jitney.scheduler.core.engine import Engine
from jitney.scheduler.api.servicer import GenerationServicer, ServingState, implementation, invariance_guaranteed
from jitney.scheduler.api.validation import ModelLimits
from jitney.scheduler.core.worker_link import WorkerLink, WorkerLinkError, WorkerLostError

log = logging.getLogger("jitney.scheduler")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Lifecycle:
    """What the serving loop drives; built by ``scheduler.main``."""

    link: WorkerLink
    servicer: GenerationServicer
    set_health: Callable[[int], Awaitable[None]]
    make_engine: Callable[[engine_pb2.Ready], Engine]
    tokenizer: Any
    address: str
    drain_seconds: float
    stop: asyncio.Event = field(default_factory=asyncio.Event)    # SIGINT: end now
    drain: asyncio.Event = field(default_factory=asyncio.Event)   # SIGTERM: drain, then end

    async def run(self) -> int:
        """Serve worker after worker until stopped or drained; the exit code."""
        lost_before = False
        while True:
            first = await _first(self.link.wait_ready(), self.stop.wait(), self.drain.wait())
            ready = first.result()      # raises WorkerLinkError on a protocol mismatch
            if not isinstance(ready, engine_pb2.Ready):
                return 0
            if lost_before:
                self.servicer.metrics.state.worker_restarts += 1
            engine = await self._start_serving(ready)
            if not await self._serve(engine):
                return 0
            lost_before = True

    async def _start_serving(self, ready: engine_pb2.Ready) -> Engine:
        engine = self.make_engine(ready)
        engine.on_step = self.servicer.metrics.observe_step
        # The scheduler's max_model_len: the model's context, capped by the cache.
        limits = ModelLimits(vocab_size=ready.vocab_size, context_length=engine.config.max_model_len)
        state = ServingState(engine, ready, limits, self.tokenizer)
        try:
            self.servicer.lora.start(ready, engine, self.servicer.served_names(state))
        except AdapterError as exc:     # a --lora-modules adapter this worker cannot serve
            raise WorkerLinkError(str(exc)) from None
        self.servicer.state = state
        self.servicer.refusing = None
        await self.set_health(SERVING)
        weights = f", {ready.quantization} weights" if ready.quantization not in ("", "none") else ""
        if implementation(ready) == "transformers":
            weights += ", through transformers' modeling code"
        name = self.servicer.served_names(state)[0]
        print(f"jitney: ready on {self.address}: {name} ({ready.dtype}{weights}, {ready.device}), "
              f"{ready.num_blocks} KV blocks of {ready.block_size} tokens, step budget "
              f"{engine.config.max_num_batched_tokens} tokens, {engine.config.max_num_seqs} seats, "
              f"warm-up {ready.warmup_seconds:.1f} s, batch-invariant {_invariance(ready)}, "
              f"worker pid {ready.worker_pid}"
              + (f", tensor-parallel over {ready.tensor_parallel_size} ranks" if ready.tensor_parallel_size > 1 else ""),
              flush=True)
        return engine

    async def _serve(self, engine: Engine) -> bool:
        """Run ``engine`` until its worker is lost (True) or the end (False)."""
        task = asyncio.create_task(engine.run())
        lost = asyncio.ensure_future(self.link.wait_lost())
        try:
            await _first(task, lost, self.stop.wait(), self.drain.wait())
            if self.drain.is_set() and not self.stop.is_set() and not task.done():
                await self._drain(engine, task, lost)
            if task.done() and not lost.done():
                self._engine_failed(task)
            if self.link.is_serving and (self.stop.is_set() or self.drain.is_set()):
                engine.close("the server is shutting down")
                await self.link.send_shutdown()
                return False
            await self._lose_worker(engine)
            return not (self.stop.is_set() or self.drain.is_set())
        finally:
            lost.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _drain(self, engine: Engine, task: asyncio.Task[None], lost: Any) -> None:
        self.servicer.refusing = "the server is draining (shutting down)"
        await self.set_health(NOT_SERVING)
        log.info("draining: %d requests in flight, up to %g s", engine.num_active,
                 self.drain_seconds)
        idle = asyncio.ensure_future(_until(lambda: engine.num_active == 0))
        try:
            await asyncio.wait_for(_first(idle, task, lost, self.stop.wait()), self.drain_seconds)
        except asyncio.TimeoutError:
            log.warning("drain: %d requests still running after %g s; ending them",
                        engine.num_active, self.drain_seconds)
        finally:
            idle.cancel()

    def _engine_failed(self, task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, WorkerLostError):
            return      # the link has declared the loss itself
        log.error("the engine loop stopped: %r", exc, exc_info=exc)
        # The worker holds state this scheduler no longer trusts: start over.
        self.link.declare_lost(f"the engine loop failed ({exc!r})")

    async def _lose_worker(self, engine: Engine) -> None:
        reason = self.link.lost_reason or "the worker was lost"
        self.servicer.state = None
        self.servicer.lora.stop()
        self.servicer.refusing = f"the worker was lost ({reason}); waiting for a new one"
        await self.set_health(NOT_SERVING)
        engine.close(f"the worker was lost before the request finished: {reason}")
        self.servicer.metrics.state.retire(engine)


async def _first(*aws: Awaitable[Any]) -> asyncio.Future[Any]:
    """Whichever of ``aws`` finishes first, as a done future; the others are
    cancelled unless they are Tasks or Futures given by the caller (those
    keep running)."""
    futures = [asyncio.ensure_future(a) for a in aws]
    owned = [f for f, a in zip(futures, aws) if f is not a]
    try:
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in owned:
            if not f.done():
                f.cancel()
    return next(f for f in futures if f in done)


async def _until(predicate: Callable[[], bool], interval: float = 0.05) -> None:
    while not predicate():
        await asyncio.sleep(interval)


def add_production_arguments(parser: Any) -> None:
    """Flags for overload, deadlines, worker faults, draining, metrics, logs."""
    parser.add_argument("--max-queued-requests", type=positive_int, default=256,
                        help="most requests waiting for a seat; beyond: RESOURCE_EXHAUSTED (default 256)")
    parser.add_argument("--max-queued-tokens", type=positive_int, default=262_144,
                        help="most tokens of waiting requests; beyond: RESOURCE_EXHAUSTED (default 262144)")
    parser.add_argument("--max-request-seconds", type=positive_float, default=None,
                        help="server cap on a request's life; the call's deadline applies too (default: none)")
    parser.add_argument("--worker-timeout", type=positive_float, default=30.0,
                        help="a worker silent this long (no heartbeat, no step reply) is lost (default 30)")
    parser.add_argument("--drain-seconds", type=non_negative_float, default=30.0,
                        help="on SIGTERM (to `jitney serve`'s pid or to its whole process group), grace for "
                             "running requests before they are ended (default 30)")
    parser.add_argument("--metrics-port", type=_metrics_port, default=0,
                        help="serve Prometheus /metrics on --host:PORT; 0 = off (default)")
    parser.add_argument("--log-prompts", action="store_true",
                        help="include prompts in the per-request log line (default: never)")


def production_fields(ns: Any) -> dict[str, Any]:
    """The SchedulerProcessConfig fields of the flags above."""
    names = ("max_queued_requests", "max_queued_tokens", "max_request_seconds",
             "worker_timeout", "drain_seconds", "metrics_port", "log_prompts")
    return {name: getattr(ns, name) for name in names}


_metrics_port = int_in(0, 65535, meaning="a TCP port or 0")


def _invariance(ready: engine_pb2.Ready) -> str:
    """The ready line's word for batch invariance: on (guaranteed), off, or kernels only."""
    if not ready.batch_invariant:
        return "off"
    if not invariance_guaranteed(ready):
        return "kernels on (not guaranteed: transformers' code runs between them)"
    return "on"

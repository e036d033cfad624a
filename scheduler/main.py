"""The scheduler process: gRPC server, tokenizer, engine loop.

Start order: bind gRPC (health NOT_SERVING, calls get UNAVAILABLE), bind the
ZeroMQ sockets, load the tokenizer, wait for the worker's Ready handshake,
size the scheduler from the cache geometry it reports, then serve.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from client._generated.jitney.v1 import generation_pb2 as pb
from client._generated.jitney.v1 import generation_pb2_grpc as pb_grpc
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.model_files import load_tokenizer, resolve_model
from scheduler.server import GenerationServicer, ServingState
from scheduler.trace import StepTracer
from scheduler.validation import ModelLimits
from scheduler.worker_link import WorkerLink

log = logging.getLogger("jitney.scheduler")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class SchedulerProcessConfig:
    """Settings of the scheduler process (flags of `jitney scheduler`)."""

    model: str | None            # model path for the tokenizer; None = bundled default
    host: str                    # gRPC bind address (loopback unless told otherwise)
    port: int                    # gRPC port
    max_num_seqs: int            # seats: sequences in one step
    max_num_batched_tokens: int  # token budget of one step
    policy: str                  # continuous | static | sequential
    plan_addr: str               # ZeroMQ endpoint the scheduler binds for plans
    result_addr: str             # ZeroMQ endpoint the scheduler binds for results
    trace: str | None = None     # write a JSONL step trace here (see scheduler/trace.py)
    prefix_cache: bool = True    # share cached prompt prefixes (off: --no-prefix-cache)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "SchedulerProcessConfig":
        return cls(ns.model, ns.host, ns.port, ns.max_num_seqs, ns.max_num_batched_tokens,
                   ns.policy, ns.plan_addr, ns.result_addr, ns.trace,
                   not ns.no_prefix_cache)


def add_scheduler_arguments(parser: argparse.ArgumentParser, *, with_shared: bool = True) -> None:
    """Flags of the scheduler process; ``with_shared=False`` leaves out those
    the worker's flags already define (for `jitney serve`)."""
    if with_shared:
        parser.add_argument("--model", default=None, help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
        parser.add_argument("--max-num-seqs", type=_positive, default=64, help="most sequences in one step")
        parser.add_argument("--max-num-batched-tokens", type=_positive, default=512, help="token budget of one step")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    parser.add_argument("--port", type=_port, default=50051, help="gRPC port")
    parser.add_argument("--policy", choices=["continuous", "static", "sequential"], default="continuous",
                        help="batching policy")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="turn off prefix caching (sharing the KV blocks of common prompt prefixes)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write a JSONL step trace (one line per step) for `jitney plot`")
    if with_shared:
        parser.add_argument("--plan-addr", default="tcp://0.0.0.0:5557", help="ZeroMQ endpoint to bind for step plans")
        parser.add_argument("--result-addr", default="tcp://0.0.0.0:5558", help="ZeroMQ endpoint to bind for step results")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {value}")
    return value


async def serve(cfg: SchedulerProcessConfig) -> int:
    servicer = GenerationServicer()
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{cfg.host}:{cfg.port}"
    if server.add_insecure_port(address) == 0:
        print(f"jitney: cannot listen on {address}", file=sys.stderr, flush=True)
        return 1
    await server.start()
    print(f"jitney: gRPC listening on {address} (waiting for the worker)", flush=True)

    link = WorkerLink(cfg.plan_addr, cfg.result_addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        files = resolve_model(cfg.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, files)
        ready = await _first(link.wait_ready(), stop)
        if ready is None:
            return 0
        engine = _make_engine(cfg, link, tokenizer, ready)
        limits = ModelLimits(vocab_size=ready.vocab_size,
                             context_length=min(ready.context_length, ready.num_blocks * ready.block_size))
        servicer.state = ServingState(engine, ready, limits, tokenizer)
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
        print(f"jitney: ready on {address}: {ready.model_name} ({ready.dtype}, {ready.device}), "
              f"{ready.num_blocks} KV blocks of {ready.block_size} tokens", flush=True)
        engine_task = asyncio.create_task(engine.run())
        await _first(engine_task, stop)
        if engine_task.done() and engine_task.exception() is not None:
            raise engine_task.exception()  # type: ignore[misc]
        engine.close("the server is shutting down")
        engine_task.cancel()
        await link.send_shutdown()
        return 0
    finally:
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=1.0)
        link.close()


def _make_engine(cfg: SchedulerProcessConfig, link: WorkerLink, tokenizer: object,
                 ready: "object") -> Engine:
    sched_cfg = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_size=ready.block_size,  # type: ignore[attr-defined]
        num_blocks=ready.num_blocks,  # type: ignore[attr-defined]
        max_model_len=min(ready.context_length,  # type: ignore[attr-defined]
                          ready.num_blocks * ready.block_size),  # type: ignore[attr-defined]
        policy=cfg.policy,
        enable_prefix_caching=cfg.prefix_cache,
    )
    tracer = StepTracer(Path(cfg.trace)) if cfg.trace else None
    return Engine(sched_cfg, link, tokenizer, frozenset(ready.eos_token_ids),  # type: ignore[attr-defined]
                  tracer=tracer)


async def _first(aw: object, stop: asyncio.Event) -> object | None:
    """Await ``aw`` unless ``stop`` is set first (then return None)."""
    task = aw if isinstance(aw, asyncio.Task) else asyncio.ensure_future(aw)  # type: ignore[arg-type]
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task in done:
        return task.result()
    return None


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    await servicer.set("", status)
    await servicer.set(SERVICE_NAME, status)


def run_scheduler(cfg: SchedulerProcessConfig) -> int:
    return asyncio.run(serve(cfg))

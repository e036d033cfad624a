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

from jitney.common.arg_types import int_in, positive_int, tcp_port
from jitney.engine.v1 import engine_pb2
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.scheduler.admission import AdmissionLimits
from jitney.scheduler.auth import ApiKeyInterceptor, KeyLimiter
from jitney.scheduler.config import SchedulerConfig, SchedulingPolicy
from jitney.scheduler.engine import Engine
from jitney.scheduler.metrics import request_log
from jitney.common.model_files import cache_root, load_tokenizer, resolve_model
from jitney.common.zmq_security import (ServerKeys, add_link_security_arguments, check_endpoint,
                                         load_server_keys)
from jitney.scheduler.server import GenerationServicer
from jitney.scheduler.security import (SecurityError, ServerSecurity, add_security_arguments,
                                       exposure_warning, load_security, security_fields)
from jitney.scheduler.serving import Lifecycle, add_production_arguments, production_fields
from jitney.scheduler.trace import StepTracer
from jitney.scheduler.worker_link import WorkerLink

log = logging.getLogger("jitney.scheduler")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class SchedulerProcessConfig:
    """Settings of the scheduler process (flags of `jitney scheduler`)."""

    model: str | None            # model path for the tokenizer; None = bundled default
    host: str                    # gRPC bind address (loopback unless told otherwise)
    port: int                    # gRPC port
    max_num_seqs: int | None            # seats: sequences in one step; None = the worker's
    max_num_batched_tokens: int | None  # token budget of one step; None = the worker's
    policy: SchedulingPolicy     # continuous | static | sequential
    plan_addr: str               # ZeroMQ endpoint the scheduler binds for plans
    result_addr: str             # ZeroMQ endpoint the scheduler binds for results
    trace: str | None = None     # write a JSONL step trace here (see scheduler/trace.py)
    prefix_cache: bool = True    # share cached prompt prefixes (off: --no-prefix-cache)
    max_queued_requests: int = 256       # waiting requests; beyond: RESOURCE_EXHAUSTED
    max_queued_tokens: int = 262_144     # tokens of waiting requests; beyond: RESOURCE_EXHAUSTED
    max_request_seconds: float | None = None  # server cap on a request's life (+ its deadline)
    worker_timeout: float = 30.0         # a worker silent this long is lost
    drain_seconds: float = 30.0          # SIGTERM: grace for running requests
    metrics_port: int = 0                # Prometheus /metrics on host:port; 0 = off
    log_prompts: bool = False            # put prompts in the per-request log line
    openai_port: int = 0                 # OpenAI-compatible HTTP API on host:port; 0 = off
    tls_cert: str | None = None          # PEM certificate chain: TLS on both doors (with tls_key)
    tls_key: str | None = None           # PEM private key of tls_cert
    tls_client_ca: str | None = None     # PEM CA that client certificates must chain to (mTLS)
    api_key_file: str | None = None      # keys that calls must bear (scheduler/security.py)
    max_requests_per_key: int | None = None  # generation requests in flight per key; None = any
    curve_keys: str | None = None        # folder of the link's Curve keys (jitney.common.zmq_security)
    insecure_plaintext_zmq: bool = False  # allow a tcp:// link without keys

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "SchedulerProcessConfig":
        return cls(ns.model, ns.host, ns.port, ns.max_num_seqs, ns.max_num_batched_tokens,
                   ns.policy, ns.plan_addr, ns.result_addr, ns.trace,
                   not ns.no_prefix_cache, **production_fields(ns), openai_port=ns.openai_port,
                   curve_keys=ns.curve_keys, insecure_plaintext_zmq=ns.insecure_plaintext_zmq,
                   **security_fields(ns))

    def load_security(self) -> tuple[ServerSecurity, list[str]]:
        """The TLS credentials and API keys of the flags, and warnings. Raises SecurityError."""
        return load_security(self.tls_cert, self.tls_key, self.tls_client_ca, self.api_key_file,
                             self.max_requests_per_key)


def add_scheduler_arguments(parser: argparse.ArgumentParser, *, with_shared: bool = True) -> None:
    """Flags of the scheduler process; ``with_shared=False`` leaves out those
    the worker's flags already define (for `jitney serve`)."""
    if with_shared:
        parser.add_argument("--model", default=None, help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
        parser.add_argument("--max-num-seqs", type=positive_int, default=None,
                            help="seats: most sequences running at once (default: the worker's)")
        parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                            help="token budget of one step (default: the worker's)")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    parser.add_argument("--port", type=tcp_port, default=50051, help="gRPC port")
    parser.add_argument("--openai-port", type=_port_or_off, default=0, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                             "/v1/completions, /v1/models) on --host:PORT; 0 = off (default)")
    parser.add_argument("--policy", choices=["continuous", "static", "sequential"], default="continuous",
                        help="batching policy")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="turn off prefix caching (sharing the KV blocks of common prompt prefixes)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write a JSONL step trace (one line per step) for `jitney plot`")
    add_production_arguments(parser)
    add_security_arguments(parser)
    if with_shared:
        parser.add_argument("--plan-addr", default="tcp://0.0.0.0:5557", help="ZeroMQ endpoint to bind for step plans")
        parser.add_argument("--result-addr", default="tcp://0.0.0.0:5558", help="ZeroMQ endpoint to bind for step results")
        add_link_security_arguments(parser)


_port_or_off = int_in(0, 65535, meaning="a TCP port (1-65535) or 0 (off)")


async def serve(cfg: SchedulerProcessConfig, *, stop: asyncio.Event | None = None,
                drain: asyncio.Event | None = None) -> int:
    """Run the scheduler process until stopped. ``stop`` / ``drain`` stand for
    SIGINT / SIGTERM; when given, no signal handler is installed (in-process tests)."""
    try:
        security, warnings = cfg.load_security()
    except SecurityError as exc:
        print(f"jitney: {exc}", file=sys.stderr, flush=True)
        return 2
    exposed = exposure_warning(cfg.host, security)
    for warning in [*warnings, *([exposed] if exposed else [])]:
        print(f"jitney: warning: {warning}", file=sys.stderr, flush=True)
    curve_keys = _link_keys(cfg)     # before anything binds: a LinkSecurityError stops the start
    servicer = GenerationServicer(api_keys=security.keys is not None,
                                  key_limits=KeyLimiter(security.max_requests_per_key))
    health_servicer = health.aio.HealthServicer()
    server = _grpc_server(servicer, health_servicer, security)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{cfg.host}:{cfg.port}"
    bound = (server.add_secure_port(address, security.tls.grpc_credentials()) if security.tls
             else server.add_insecure_port(address))
    if bound == 0:
        print(f"jitney: cannot listen on {address}", file=sys.stderr, flush=True)
        return 1
    await server.start()
    print(f"jitney: gRPC listening on {address} ({_door_security(security)}; waiting for the worker)",
          flush=True)

    if cfg.metrics_port:
        servicer.metrics.serve_http(cfg.host, cfg.metrics_port)
        print(f"jitney: metrics on http://{cfg.host}:{cfg.metrics_port}/metrics", flush=True)
    servicer.metrics.log_prompts = cfg.log_prompts
    link = WorkerLink(cfg.plan_addr, cfg.result_addr, worker_timeout=cfg.worker_timeout,
                      curve_keys=curve_keys, insecure_plaintext=cfg.insecure_plaintext_zmq)
    # One trace for the process: engines of restarted workers append to it.
    tracer = StepTracer(Path(cfg.trace)) if cfg.trace else None
    if stop is None or drain is None:
        stop, drain = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)     # end now
        loop.add_signal_handler(signal.SIGTERM, drain.set)   # drain, then end
    openai_server = None
    try:
        if cfg.openai_port:
            # Imported only when asked for: aiohttp stays out of a plain gRPC server.
            from jitney.scheduler.openai_api import OpenAIServer

            openai_server = OpenAIServer(servicer, security.keys)
            try:
                await openai_server.start(cfg.host, cfg.openai_port,
                                          security.tls.ssl_context() if security.tls else None)
            except OSError as exc:
                openai_server = None
                print(f"jitney: cannot listen on {cfg.host}:{cfg.openai_port} (OpenAI API): {exc}",
                      file=sys.stderr, flush=True)
                return 1
            scheme = "https" if security.tls else "http"
            print(f"jitney: OpenAI-compatible API on {scheme}://{cfg.host}:{cfg.openai_port}/v1",
                  flush=True)
        files = resolve_model(cfg.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, files, cache_root())
        life = Lifecycle(link, servicer, lambda status: _set_health(health_servicer, status),
                         lambda ready: _make_engine(cfg, link, tokenizer, ready, tracer), tokenizer,
                         address, cfg.drain_seconds, stop, drain)
        return await life.run()
    finally:
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=1.0)
        if openai_server is not None:
            await openai_server.stop()
        link.close()
        if tracer is not None:
            tracer.close()


def _link_keys(cfg: SchedulerProcessConfig) -> ServerKeys | None:
    """The link's Curve keys (None without --curve-keys), once the endpoints are known to be allowed."""
    keys = load_server_keys(cfg.curve_keys) if cfg.curve_keys else None
    for endpoint in (cfg.plan_addr, cfg.result_addr):
        check_endpoint(endpoint, have_keys=keys is not None, insecure_plaintext=cfg.insecure_plaintext_zmq)
    return keys


def _grpc_server(servicer: GenerationServicer, health_servicer: health.aio.HealthServicer,
                 security: ServerSecurity) -> grpc.aio.Server:
    """The gRPC server with its three services; with API keys, their interceptor."""
    interceptors = []
    if security.keys is not None:
        def refused(method: str, peer: str, why: str) -> None:
            servicer.metrics.failure("UNAUTHENTICATED")
            request_log.info("call %s from %s: rejected UNAUTHENTICATED (%s)", method, peer, why)

        interceptors.append(ApiKeyInterceptor(security.keys, refused))
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server


def _door_security(security: ServerSecurity) -> str:
    tls = "plaintext" if security.tls is None else (
        "mutual TLS" if security.tls.client_ca is not None else "TLS")
    if security.keys is None:
        return tls
    limit = f", at most {security.max_requests_per_key} in flight each" if security.max_requests_per_key else ""
    return f"{tls}, {len(security.keys.names)} API keys{limit}"


def _make_engine(cfg: SchedulerProcessConfig, link: WorkerLink, tokenizer: object,
                 ready: engine_pb2.Ready, tracer: StepTracer | None) -> Engine:
    sched_cfg = SchedulerConfig(
        max_num_seqs=_step_limit("max_num_seqs", cfg.max_num_seqs, ready.max_num_seqs),
        max_num_batched_tokens=_step_limit("max_num_batched_tokens", cfg.max_num_batched_tokens,
                                           ready.max_num_batched_tokens),
        block_size=ready.block_size,
        num_blocks=ready.num_blocks,
        max_model_len=min(ready.context_length, ready.num_blocks * ready.block_size),
        policy=cfg.policy,
        enable_prefix_caching=cfg.prefix_cache,
    )
    admission = AdmissionLimits(cfg.max_queued_requests, cfg.max_queued_tokens,
                                cfg.max_request_seconds)
    return Engine(sched_cfg, link, tokenizer, frozenset(ready.eos_token_ids),
                  tracer=tracer, admission=admission, vocab_size=ready.vocab_size)


def _step_limit(name: str, asked: int | None, worker: int) -> int:
    """The scheduler's flag, or the worker's value when unset; never more than the worker accepts."""
    if asked is None:
        return worker
    if asked > worker:
        log.warning("--%s %d is more than the worker accepts (%d): using %d",
                       name.replace("_", "-"), asked, worker, worker)
        return worker
    return asked


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    await servicer.set("", status)
    await servicer.set(SERVICE_NAME, status)


def run_scheduler(cfg: SchedulerProcessConfig) -> int:
    return asyncio.run(serve(cfg))

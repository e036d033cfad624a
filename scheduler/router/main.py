"""The `jitney router` process: flags, start, health rounds, drain.

Start order: bind gRPC (health NOT_SERVING), load the replicas' tokenizer
(cache-aware routing of text and chat prompts), then poll the replicas; the
router turns SERVING with the first replica that does. SIGTERM: NOT_SERVING,
new calls refused, calls in flight get --drain-seconds to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jitney.common.arg_types import non_negative_float, non_negative_int, positive_float, positive_int, tcp_port
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.scheduler.router.replicas import MAX_MESSAGE_BYTES, Replica, ReplicaSet, ReplicaTls
from jitney.scheduler.router.servicer import RouterServicer, keep_health
from jitney.scheduler.router.routing import POLICIES, RoutingConfig, RoutingPolicy
from jitney.scheduler.security.tls import SecurityError, listen_grpc, load_security

log = logging.getLogger("jitney.router")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
API_KEY_ENV = "JITNEY_API_KEY"


@dataclass(frozen=True)
class RouterConfig:
    """Settings of the router process (flags of `jitney router`)."""

    replicas: tuple[str, ...]              # HOST:PORT of each replica
    host: str = "127.0.0.1"                # gRPC bind address
    port: int = 50050                      # gRPC port
    routing: RoutingConfig = RoutingConfig()
    model: str | None = None               # the replicas' model, for its tokenizer; None = bundled
    tokenizer: bool = True                 # load it (off: text and chat prompts route by load)
    health_interval: float = 1.0           # seconds between health rounds
    health_timeout: float = 2.0            # deadline of each poll call
    drain_seconds: float = 30.0            # SIGTERM: grace for calls in flight
    tls_cert: str | None = None            # serve TLS (with tls_key)
    tls_key: str | None = None
    tls_client_ca: str | None = None       # require client certificates of this CA
    replica_tls: ReplicaTls | None = None  # TLS toward the replicas (None: plaintext)
    replica_api_key: str | None = None     # the router's own key, for its polls

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "RouterConfig":
        import os

        tls = (ReplicaTls(ns.replica_tls_ca, ns.replica_tls_cert, ns.replica_tls_key)
               if ns.replica_tls or ns.replica_tls_ca or ns.replica_tls_cert else None)
        routing = RoutingConfig(ns.policy, ns.overload_threshold, ns.min_prefix_blocks, ns.table_blocks)
        return cls(tuple(ns.replica), ns.host, ns.port, routing, ns.model, not ns.no_tokenizer,
                   ns.health_interval, ns.health_timeout, ns.drain_seconds, ns.tls_cert, ns.tls_key,
                   ns.tls_client_ca, tls, ns.replica_api_key or os.environ.get(API_KEY_ENV) or None)


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, metavar="HOST:PORT",
                   help="a Jitney server to route to (repeat once per replica)")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default 127.0.0.1)")
    p.add_argument("--port", type=tcp_port, default=50050, help="gRPC port (default 50050)")
    p.add_argument("--policy", choices=POLICIES, default="cache-aware",
                   help="cache-aware: the replica sent the longest prefix of the prompt before, else the "
                        "least loaded; least-loaded; round-robin (default cache-aware)")
    p.add_argument("--overload-threshold", type=non_negative_int, default=8, metavar="N",
                   help="cache-aware: pass over the best-prefix replica when its requests in flight exceed "
                        "the least loaded replica's by more than N (default 8)")
    p.add_argument("--min-prefix-blocks", type=positive_int, default=1, metavar="N",
                   help="cache-aware: a prefix shorter than N whole KV blocks routes by load (default 1)")
    p.add_argument("--table-blocks", type=positive_int, default=262_144, metavar="N",
                   help="cache-aware: most block hashes remembered per replica (also capped by the "
                        "replica's own KV blocks; least recently sent evicted first; default 262144)")
    p.add_argument("--model", default=None,
                   help="the replicas' model (HF folder or .gguf), for its tokenizer: text and chat prompts "
                        "are tokenized to route them by prefix (default: the bundled default model)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="load no tokenizer: text and chat prompts route by load, token-id prompts by prefix")
    p.add_argument("--health-interval", type=positive_float, default=1.0, metavar="S",
                   help="seconds between health rounds over the replicas (default 1)")
    p.add_argument("--health-timeout", type=positive_float, default=2.0, metavar="S",
                   help="deadline of each health, stats and model-info poll (default 2)")
    p.add_argument("--drain-seconds", type=non_negative_float, default=30.0,
                   help="on SIGTERM, grace for calls in flight (default 30)")
    door = p.add_argument_group("the router's own door")
    door.add_argument("--tls-cert", default=None, metavar="FILE", help="serve TLS with this PEM chain (with --tls-key)")
    door.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    door.add_argument("--tls-client-ca", default=None, metavar="FILE",
                      help="require client certificates signed by this PEM CA (mutual TLS)")
    up = p.add_argument_group("toward the replicas", "API keys are not checked by the router: each call's "
                              "`authorization` metadata is passed to the replica, which checks it")
    up.add_argument("--replica-tls", action="store_true",
                    help="connect to the replicas over TLS with the system's CA roots (implied by --replica-tls-*)")
    up.add_argument("--replica-tls-ca", default=None, metavar="FILE", help="PEM CA certificates that verify the replicas")
    up.add_argument("--replica-tls-cert", default=None, metavar="FILE",
                    help="PEM client certificate, for replicas that require one (with --replica-tls-key)")
    up.add_argument("--replica-tls-key", default=None, metavar="FILE", help="PEM private key of --replica-tls-cert")
    up.add_argument("--replica-api-key", default=None, metavar="KEY",
                    help=f"the router's own key for its polls (GetServerStats, GetModelInfo) of replicas run "
                         f"with --api-key-file (default: ${API_KEY_ENV})")


async def serve(cfg: RouterConfig, *, stop: asyncio.Event | None = None) -> int:
    """Run the router until SIGINT (now) or SIGTERM (drain); ``stop`` stands for both in tests."""
    try:
        security, _ = load_security(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, None, None)
        channels = [_replica_channel(t, cfg.replica_tls) for t in cfg.replicas]
    except (SecurityError, ValueError, OSError) as exc:
        print(f"jitney router: {exc}", file=sys.stderr, flush=True)
        return 2
    metadata = (("authorization", f"Bearer {cfg.replica_api_key}"),) if cfg.replica_api_key else ()
    replicas = ReplicaSet([Replica(t, c) for t, c in zip(cfg.replicas, channels)],
                          RoutingPolicy(cfg.routing), metadata=metadata, timeout=cfg.health_timeout)
    servicer = RouterServicer(replicas)
    health_servicer = health.aio.HealthServicer()
    server = _grpc_server(servicer, health_servicer)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{cfg.host}:{cfg.port}"
    if (refused := listen_grpc(server, cfg.host, cfg.port, security)) is not None:
        print(f"jitney router: cannot listen on {address} (--port {cfg.port}): {refused}",
              file=sys.stderr, flush=True)
        for channel in channels:
            await channel.close()
        return 2
    await server.start()
    stop, drain = _signals(stop)
    poller: asyncio.Task[None] | None = None
    try:
        if cfg.tokenizer and cfg.routing.policy == "cache-aware":
            servicer.tokenizer = await asyncio.to_thread(_load_tokenizer, cfg.model)
        poller = asyncio.create_task(keep_health(replicas, health_servicer, SERVICE_NAME, cfg.health_interval))
        print(f"jitney router: listening on {address} ({'TLS' if security.tls else 'plaintext'}), "
              f"policy {cfg.routing.policy}, replicas {', '.join(cfg.replicas)}", flush=True)
        done, _ = await asyncio.wait([asyncio.ensure_future(stop.wait()), asyncio.ensure_future(drain.wait()),
                                      poller], return_when=asyncio.FIRST_COMPLETED)
        if poller in done:
            poller.result()      # raises what stopped it
        grace = cfg.drain_seconds if drain.is_set() and not stop.is_set() else 0.0
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=grace)
        return 0
    finally:
        if poller is not None:
            poller.cancel()
        await server.stop(grace=None)
        for channel in channels:
            await channel.close()


def _signals(stop: asyncio.Event | None) -> tuple[asyncio.Event, asyncio.Event]:
    if stop is not None:
        return stop, asyncio.Event()
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, drain.set)
    return stop, drain


def _replica_channel(target: str, tls: ReplicaTls | None) -> grpc.aio.Channel:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options=options)
    return grpc.aio.insecure_channel(target, options=options)


def _grpc_server(servicer: RouterServicer, health_servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    # so_reuseport 0: a second server on this port fails its bind instead of sharing it.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server


def _load_tokenizer(model: str | None) -> Any:
    from jitney.common.model_files import cache_root, load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model), cache_root())


def run_router(cfg: RouterConfig) -> int:
    return asyncio.run(serve(cfg))

"""The replicas behind `jitney router`: channels, health, load, geometry.

Every ``--health-interval`` seconds the router asks each replica, at once:

    grpc.health.v1 Check   SERVING?                  (no API key needed)
    GetServerStats         requests running + waiting, worker pid
    GetModelInfo           block size, KV blocks     (when the worker changed)

A replica serves new requests only while its last round said SERVING and it
answered all three. A request that gets UNAVAILABLE from it also takes it
out at once, until a later round finds it SERVING again. A new worker pid
(a restarted worker or replica) means its KV cache is empty: its prefix
table is cleared.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.scheduler.router.routing import Candidate, RoutingPolicy

log = logging.getLogger("jitney.router")

Metadata = tuple[tuple[str, str], ...]
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class ReplicaTls:
    """TLS toward the replicas (the client commands' --tls-* flags). ``ca``:
    PEM roots that verify them (None: the system's); ``cert`` + ``key``: the
    router's client certificate, for replicas that require one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """Raises ValueError (a certificate without its key) or OSError (a file unread)."""
        if (self.cert is None) != (self.key is None):
            raise ValueError("--replica-tls-cert and --replica-tls-key go together")

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


class Replica:
    """One replica as the router knows it."""

    def __init__(self, target: str, channel: grpc.aio.Channel) -> None:
        self.target = target
        self.channel = channel
        self.stub = pb_grpc.GenerationServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.serving = False
        self.problem = "not checked yet"         # why not serving
        self.info: pb.GetModelInfoResponse | None = None
        self.worker_pid = 0
        self.in_flight = 0                       # this router's requests there now
        self.reported = 0                        # running + waiting at the last poll
        self.in_flight_at_poll = 0
        self.routed = 0
        self.prefix_routed = 0

    @property
    def load(self) -> int:
        """Requests in flight there: this router's, counted live, plus those
        others sent it (the last poll's figure beyond this router's own)."""
        return self.in_flight + max(0, self.reported - self.in_flight_at_poll)

    def candidate(self) -> Candidate:
        assert self.info is not None
        return Candidate(self.target, self.load, self.info.block_size)

    def mark_down(self, problem: str) -> None:
        if self.serving:
            log.warning("replica %s: out of rotation (%s)", self.target, problem)
        self.serving, self.problem = False, problem


class ReplicaSet:
    """The replicas, in --replica order, and the health rounds that keep
    ``serving`` and the load figures current."""

    def __init__(self, replicas: Sequence[Replica], policy: RoutingPolicy, *,
                 metadata: Metadata = (), timeout: float = 2.0) -> None:
        self.replicas = list(replicas)
        self.policy = policy
        self.metadata = metadata          # the router's own key, for its polls
        self.timeout = timeout

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.serving and r.info is not None]

    def problems(self) -> str:
        return "; ".join(f"{r.target}: {r.problem}" for r in self.replicas if not r.serving)

    async def poll_all(self) -> bool:
        """One round over every replica; whether any serves."""
        await asyncio.gather(*(self.poll(r) for r in self.replicas))
        return bool(self.serving())

    async def poll(self, replica: Replica) -> None:
        try:
            check = await replica.health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout)
            if check.status != SERVING:
                replica.mark_down(f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)}")
                return
            stats = await replica.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=self.timeout,
                                                      metadata=self.metadata)
            if replica.info is None or stats.worker_pid != replica.worker_pid:
                info = await replica.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout,
                                                       metadata=self.metadata)
                self._new_worker(replica, info, stats.worker_pid)
        except grpc.aio.AioRpcError as err:
            replica.mark_down(f"{err.code().name}: {err.details()}")
            return
        replica.reported = stats.requests_running + stats.requests_waiting
        replica.in_flight_at_poll = replica.in_flight
        if not replica.serving:
            log.info("replica %s: serving (%s, blocks of %d tokens, worker pid %d)", replica.target,
                     replica.info.model_name if replica.info else "?",
                     replica.info.block_size if replica.info else 0, replica.worker_pid)
        replica.serving, replica.problem = True, ""

    def _new_worker(self, replica: Replica, info: pb.GetModelInfoResponse, worker_pid: int) -> None:
        """A first contact or a new worker: its cache is empty, its geometry may differ."""
        if replica.info is not None:
            log.info("replica %s: new worker (pid %d -> %d): its prefix table is cleared",
                     replica.target, replica.worker_pid, worker_pid)
        replica.info, replica.worker_pid = info, worker_pid
        self.policy.forget(replica.target)
        self.policy.set_capacity(replica.target, info.num_kv_blocks)
        others = {(r.info.model_name, r.info.block_size) for r in self.replicas
                  if r.info is not None and r is not replica}
        if others and (info.model_name, info.block_size) not in others:
            log.warning("replica %s serves %s with blocks of %d tokens, unlike the others (%s)",
                        replica.target, info.model_name, info.block_size, sorted(others))

"""`jitney router` in-process against fake replicas (small grpc.aio servers
that fail on cue): retries, pass-through of errors, deadlines, metadata and
cancellation, health, the summed stats, and LoRA loads on every replica. No
model, no processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.certs import Pki
from tests.support.server_harness import free_port
from jitney.scheduler.router.replicas import ReplicaTls
from jitney.scheduler.router.main import RouterConfig, serve
from jitney.scheduler.router.routing import RoutingConfig
from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BLOCK = 4
PREFIX = list(range(10, 30))           # five blocks


@dataclass
class FakeReplica(pb_grpc.GenerationServiceServicer):
    """``mode``: ok | unavailable (before any message) | unavailable-after-one
    | invalid | hang (one message, then waits until cancelled)."""

    mode: str = "ok"
    calls: int = 0
    running: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    time_remaining: float | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    hits: int = 0
    lora: str = "ok"              # ok | refuse (its loads) | no-undo (accepts loads, its unloads fail) | slow (loads take 5 s)
    adapters: dict[str, str] = field(default_factory=dict)

    async def _enter(self, context: grpc.aio.ServicerContext) -> None:
        self.calls += 1
        self.metadata = {k: v for k, v in context.invocation_metadata() or ()}
        self.time_remaining = context.time_remaining()
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker was lost")
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "params.sampling.top_p: must be in (0, 1]")

    async def GenerateStream(self, request: Any, context: Any) -> AsyncIterator[pb.GenerateStreamResponse]:  # type: ignore[override]
        await self._enter(context)
        self.running += 1
        try:
            yield pb.GenerateStreamResponse(request_id=request.params.request_id, token_ids=[1], text="a")
            if self.mode == "unavailable-after-one":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker was lost mid-stream")
            if self.mode == "hang":
                await asyncio.sleep(60)
            yield pb.GenerateStreamResponse(token_ids=[2], text="b", finish_reason=pb.FINISH_REASON_LENGTH)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.running -= 1

    async def Generate(self, request: Any, context: Any) -> pb.GenerateResponse:
        await self._enter(context)
        return pb.GenerateResponse(request_id=request.params.request_id, text="ab", token_ids=[1, 2])

    async def LoadLoraAdapter(self, request: Any, context: Any) -> pb.LoadLoraAdapterResponse:
        await self._enter(context)
        if self.lora == "slow":
            await asyncio.sleep(5)
        if self.lora == "refuse":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: rank 64 is above --max-lora-rank 16")
        if request.lora_name in self.adapters:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"lora_name: {request.lora_name!r} is loaded")
        self.adapters[request.lora_name] = request.lora_path
        return pb.LoadLoraAdapterResponse(rank=8, target_modules=["q_proj", "v_proj"])

    async def UnloadLoraAdapter(self, request: Any, context: Any) -> pb.UnloadLoraAdapterResponse:
        await self._enter(context)
        if self.lora == "no-undo":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker was lost")
        if self.adapters.pop(request.lora_name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter named {request.lora_name!r}")
        return pb.UnloadLoraAdapterResponse()

    async def GetModelInfo(self, request: Any, context: Any) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(model_name="fake", block_size=BLOCK, num_kv_blocks=64)

    async def GetServerStats(self, request: Any, context: Any) -> pb.GetServerStatsResponse:
        return pb.GetServerStatsResponse(requests_running=self.running, kv_blocks_total=64, worker_pid=42,
                                         prefix_cache_hit_tokens=self.hits, prefix_cache_queried_tokens=100)


@dataclass
class Cluster:
    fakes: list[FakeReplica]
    healths: list[health.aio.HealthServicer]
    stub: pb_grpc.GenerationServiceStub
    health: health_pb2_grpc.HealthStub
    targets: list[str]


async def _start_fake(fake: FakeReplica, pki: Pki | None = None
                      ) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    server = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = free_port()
    if pki is None:
        server.add_insecure_port(f"127.0.0.1:{port}")
    else:       # mutual TLS: the router must show a client certificate of the CA
        server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials(
            [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
            root_certificates=pki.ca.read_bytes(), require_client_auth=True))
    await server.start()
    await health_servicer.set("", SERVING)
    return server, health_servicer, f"127.0.0.1:{port}"


async def _wait_health(stub: health_pb2_grpc.HealthStub, status: int, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            if (await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)).status == status:
                return
        except grpc.aio.AioRpcError:
            pass
        assert asyncio.get_running_loop().time() < deadline, f"router health never {status}"
        await asyncio.sleep(0.05)


def run_cluster(modes: list[str], body: Callable[[Cluster], Awaitable[None]],
                policy: str = "cache-aware", replica_targets: list[str] | None = None,
                pki: Pki | None = None, lora: list[str] | None = None) -> None:
    """Start fake replicas of ``modes`` (and ``lora`` modes) and a router in front; run
    ``body``. With ``pki``: TLS everywhere (the replicas require the router's client certificate)."""
    async def main() -> None:
        fakes = [FakeReplica(mode, lora=kind) for mode, kind in zip(modes, lora or ["ok"] * len(modes))]
        started = [await _start_fake(f, pki) for f in fakes]
        stop = asyncio.Event()
        port = free_port()
        tls = {} if pki is None else dict(
            tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
            replica_tls=ReplicaTls(str(pki.ca), str(pki.client_cert), str(pki.client_key)))
        cfg = RouterConfig(tuple(replica_targets or [t for _, _, t in started]), port=port,
                           routing=RoutingConfig(policy), tokenizer=False, health_interval=0.05,
                           health_timeout=1.0, **tls)  # type: ignore[arg-type]
        router = asyncio.create_task(serve(cfg, stop=stop))
        target = f"127.0.0.1:{port}"
        try:
            async with (grpc.aio.insecure_channel(target) if pki is None else grpc.aio.secure_channel(
                    target, grpc.ssl_channel_credentials(pki.ca.read_bytes()))) as channel:
                cluster = Cluster(fakes, [h for _, h, _ in started], pb_grpc.GenerationServiceStub(channel),
                                  health_pb2_grpc.HealthStub(channel), [t for _, _, t in started])
                if replica_targets is None:
                    await _wait_health(cluster.health, SERVING)
                await body(cluster)
        finally:
            stop.set()
            assert await asyncio.wait_for(router, 10) == 0
            for server, _, _ in started:
                await server.stop(None)
    asyncio.run(main())


def stream_request(ids: list[int] | None = None, request_id: str = "") -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(params=pb.GenerationParams(
        token_ids=pb.TokenIds(ids=ids or PREFIX), request_id=request_id))


async def collect(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateStreamRequest,
                  **kw: Any) -> list[pb.GenerateStreamResponse]:
    return [m async for m in stub.GenerateStream(request, **kw)]


def test_unavailable_before_streaming_is_retried_once_on_another_replica() -> None:
    async def body(c: Cluster) -> None:
        messages = await collect(c.stub, stream_request(request_id="r1"))   # r0 is first in turn
        assert [m.text for m in messages] == ["a", "b"] and messages[0].request_id == "r1"
        assert [f.calls for f in c.fakes] == [1, 1]
        stats = await c.stub.GetServerStats(pb.GetServerStatsRequest())
        assert stats.router_retried_requests == 1
        reply = await c.stub.Generate(pb.GenerateRequest(params=stream_request().params))
        assert reply.text == "ab" and c.fakes[1].calls == 2      # r0 is out of rotation now
    run_cluster(["unavailable", "ok"], body)


def test_unavailable_after_streaming_ends_the_call() -> None:
    async def body(c: Cluster) -> None:
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for m in c.stub.GenerateStream(stream_request()):
                received.append(m.text)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert received == ["a"] and [f.calls for f in c.fakes] == [1, 0]
    run_cluster(["unavailable-after-one", "ok"], body)


def test_a_request_is_retried_only_once() -> None:
    async def body(c: Cluster) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(c.stub, stream_request())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "the worker was lost"
        assert [f.calls for f in c.fakes] == [1, 0, 1]
    run_cluster(["unavailable", "ok", "unavailable"], body, policy="round-robin")   # r0, then r2


def test_replica_errors_pass_through_untouched_and_are_not_retried() -> None:
    async def body(c: Cluster) -> None:
        for call in (collect(c.stub, stream_request()),
                     c.stub.Generate(pb.GenerateRequest(params=stream_request().params))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "params.sampling.top_p: must be in (0, 1]"
        assert sum(f.calls for f in c.fakes) == 2
    run_cluster(["invalid", "invalid"], body)


def test_deadline_and_metadata_pass_through() -> None:
    async def body(c: Cluster) -> None:
        await collect(c.stub, stream_request(), timeout=7.0,
                      metadata=(("authorization", "Bearer k1"), ("x-tenant", "t")))
        fake = next(f for f in c.fakes if f.calls)
        assert fake.metadata["authorization"] == "Bearer k1" and fake.metadata["x-tenant"] == "t"
        assert fake.time_remaining is not None and 5.0 < fake.time_remaining <= 7.1   # (the wire rounds up)
    run_cluster(["ok", "ok"], body)


def test_a_cancelled_client_cancels_the_replica_call_at_once() -> None:
    async def body(c: Cluster) -> None:
        call = c.stub.GenerateStream(stream_request())
        assert (await call.read()).text == "a"
        call.cancel()
        fake = next(f for f in c.fakes if f.calls)
        await asyncio.wait_for(fake.cancelled.wait(), 2.0)
        stats = await c.stub.GetServerStats(pb.GetServerStatsRequest())
        assert all(r.in_flight == 0 for r in stats.replicas)
    run_cluster(["hang", "hang"], body)


def test_shared_prefixes_stick_to_one_replica_and_stats_sum_the_replicas() -> None:
    async def body(c: Cluster) -> None:
        c.fakes[0].hits, c.fakes[1].hits = 30, 12
        for tail in range(6):
            await collect(c.stub, stream_request(PREFIX + [tail]))
        assert sorted(f.calls for f in c.fakes) == [0, 6]
        await collect(c.stub, stream_request([99] * 20))     # no prefix in common: by load
        stats = await c.stub.GetServerStats(pb.GetServerStatsRequest())
        assert (stats.kv_blocks_total, stats.prefix_cache_hit_tokens, stats.prefix_cache_queried_tokens) == (
            128, 42, 200)
        assert [r.stats.prefix_cache_hit_tokens for r in stats.replicas] == [30, 12]
        assert [r.routed_requests for r in stats.replicas] == [f.calls for f in c.fakes]
        assert sum(f.calls for f in c.fakes) == 7
        assert sorted(r.prefix_routed_requests for r in stats.replicas) == [0, 5]
        assert all(r.serving and not r.error for r in stats.replicas)
    run_cluster(["ok", "ok"], body)


def test_every_stats_counter_is_summed_or_said_not_to_be() -> None:
    """A field added to GetServerStatsResponse must be summed by the router (or listed as not)."""
    from jitney.scheduler.router.servicer import NOT_SUMMED_STATS, SUMMED_STATS
    scalars = {f.name for f in pb.GetServerStatsResponse.DESCRIPTOR.fields if f.message_type is None}
    assert scalars == set(SUMMED_STATS) | set(NOT_SUMMED_STATS)
    assert not set(SUMMED_STATS) & set(NOT_SUMMED_STATS)


def test_health_follows_the_replicas() -> None:
    async def body(c: Cluster) -> None:
        for h in c.healths:
            await h.set("", NOT_SERVING)
        await _wait_health(c.health, NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(c.stub, stream_request())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy replica" in (err.value.details() or "")
        assert "health NOT_SERVING" in (err.value.details() or "")
        await c.healths[1].set("", SERVING)
        await _wait_health(c.health, SERVING)
        await collect(c.stub, stream_request())
        assert [f.calls for f in c.fakes] == [0, 1]
    run_cluster(["ok", "ok"], body)


def test_with_no_replica_reachable_calls_get_unavailable() -> None:
    async def body(c: Cluster) -> None:
        await asyncio.sleep(0.3)
        assert (await c.health.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy replica (127.0.0.1:" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.GetServerStats(pb.GetServerStatsRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    run_cluster([], body, replica_targets=[f"127.0.0.1:{free_port()}"])


def test_tls_on_both_sides(tmp_path: Any) -> None:
    from tests.support.certs import make_pki

    async def body(c: Cluster) -> None:
        assert [m.text for m in await collect(c.stub, stream_request())] == ["a", "b"]
    run_cluster(["ok"], body, pki=make_pki(tmp_path))


def test_router_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from jitney.cli import build_parser

    monkeypatch.setenv("JITNEY_API_KEY", "from-env")
    ns = build_parser().parse_args(["router", "--replica", "a:1", "--replica", "b:2", "--policy", "round-robin",
                                    "--overload-threshold", "3", "--replica-tls-ca", "ca.pem", "--no-tokenizer"])
    cfg = RouterConfig.from_namespace(ns)
    assert cfg.replicas == ("a:1", "b:2") and cfg.port == 50050 and not cfg.tokenizer
    assert cfg.routing == RoutingConfig("round-robin", 3)
    assert cfg.replica_tls == ReplicaTls("ca.pem") and cfg.replica_api_key == "from-env"
    assert RouterConfig.from_namespace(build_parser().parse_args(["router", "--replica", "a:1"])).replica_tls is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router"])              # at least one --replica


KEY = (("authorization", "Bearer k1"),)


def test_lora_loads_and_unloads_go_to_every_replica_with_the_callers_key() -> None:
    async def body(c: Cluster) -> None:
        reply = await c.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/a/sql"),
                                             metadata=KEY)
        assert (reply.rank, list(reply.target_modules)) == (8, ["q_proj", "v_proj"])
        assert [f.adapters for f in c.fakes] == [{"sql": "/a/sql"}] * 3
        assert all(f.metadata["authorization"] == "Bearer k1" for f in c.fakes)
        await c.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="sql"), metadata=KEY)
        assert [f.adapters for f in c.fakes] == [{}] * 3 and [f.calls for f in c.fakes] == [2] * 3
        # an unload some replicas refuse: the others' is not undone, the reply says where it went
        c.fakes[1].adapters["chat"] = "/a/chat"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="chat"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == (f"replica {c.targets[0]}: lora_name: no adapter named 'chat'; "
                                       f"it was unloaded from {c.targets[1]}")
        assert [f.adapters for f in c.fakes] == [{}] * 3
    run_cluster(["ok", "ok", "ok"], body)


def test_a_lora_load_one_replica_refuses_is_undone_on_the_others() -> None:
    async def body(c: Cluster) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="big", lora_path="/a/big"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (f"replica {c.targets[1]}: lora_path: rank 64 is above --max-lora-rank "
                                       f"16; the load was undone on {c.targets[0]}, {c.targets[2]}")
        assert [f.adapters for f in c.fakes] == [{}] * 3
        assert [f.calls for f in c.fakes] == [2, 1, 2]       # the load, then the undo
    run_cluster(["ok", "ok", "ok"], body, lora=["ok", "refuse", "ok"])


def test_a_lora_load_an_unreachable_replica_misses_is_undone_and_a_failed_undo_is_named() -> None:
    async def body(c: Cluster) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/a/sql"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == (
            f"replica {c.targets[0]}: the worker was lost; the load was undone on {c.targets[1]}; it could not "
            f"be undone on {c.targets[2]} (UNAVAILABLE: the worker was lost): unload it there")
        assert [f.adapters for f in c.fakes] == [{}, {}, {"sql": "/a/sql"}]
        # the replica that holds it now refuses the same name: nothing changes elsewhere
        c.fakes[0].mode = "ok"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/a/sql"))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert [f.adapters for f in c.fakes] == [{}, {}, {"sql": "/a/sql"}]
    run_cluster(["unavailable", "ok", "ok"], body, lora=["ok", "ok", "no-undo"])


def test_a_lora_load_whose_caller_gives_up_is_still_undone() -> None:
    """The caller's deadline passes while one replica is still loading: the router's
    handler is cancelled, and the load that replica 0 accepted is undone all the same."""
    async def body(c: Cluster) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/a/sql"), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = asyncio.get_running_loop().time() + 5
        while c.fakes[0].adapters and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert [f.adapters for f in c.fakes] == [{}, {}]
        assert c.fakes[0].calls == 2                      # the load, then the undo
    run_cluster(["ok", "ok"], body, lora=["ok", "slow"])

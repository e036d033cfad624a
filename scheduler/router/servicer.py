"""`jitney router`: jitney.v1 in front of N Jitney replicas.

    clients ──► router ──(policy: scheduler/router/routing.py)──► replica 1 .. N

The router speaks the same public API (plus health and reflection) and
forwards each call whole: the request message, the caller's metadata (its
API key included) and its deadline. It validates nothing: a bad request gets
the replica's own status. It keeps no request state beyond the call.

* Generate / GenerateStream go where the policy says. A call that fails with
  UNAVAILABLE before any response reached the client is sent once more, to
  another replica; after a response was streamed, UNAVAILABLE ends it.
* A client that cancels, or whose deadline passes, cancels the replica's call
  at once (the handler's ``finally``).
* Tokenize and GetModelInfo go to the least loaded replica; GetServerStats
  asks every replica and returns the sums and each replica's own answer.
* LoadLoraAdapter / UnloadLoraAdapter go to every replica at once
  (scheduler/router/lora.py): a load that any replica refuses is undone on
  those that accepted it.
* Health: SERVING while at least one replica serves (scheduler/router/replicas.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health

from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc
from jitney.scheduler.router.lora import AdminFailure, load_everywhere, unload_everywhere
from jitney.scheduler.router.replicas import Metadata, Replica, ReplicaSet
from jitney.scheduler.router.routing import Prompt, RoutingPolicy
from jitney.scheduler.api.validation import ModelLimits, render_prompt
from jitney.scheduler.core.request import InvalidRequestError

log = logging.getLogger("jitney.router")

# Summed over the replicas by GetServerStats.
SUMMED_STATS = ("requests_running", "requests_waiting", "kv_blocks_total", "kv_blocks_used", "steps",
                "preemptions", "worker_restarts", "prefix_cache_queried_tokens",
                "prefix_cache_hit_tokens", "grammar_masked_steps", "grammar_mask_seconds",
                "grammar_forced_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
# Not summed: the worker's pid means one process; the router's own counter it sets itself.
NOT_SUMMED_STATS = ("worker_pid", "router_retried_requests")
# Metadata that belongs to the caller's connection, not to the request.
_NOT_FORWARDED = {"user-agent", "content-type", "te", "accept-encoding"}
# Token ids are only routed on; the replica checks them against its vocabulary.
_LENIENT = ModelLimits(vocab_size=2**32, context_length=2**31)


def forwarded_metadata(context: grpc.aio.ServicerContext) -> Metadata:
    """The caller's metadata that travels on (authorization, custom keys)."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if not (k.startswith((":", "grpc-")) or k in _NOT_FORWARDED))


class RouterServicer(pb_grpc.GenerationServiceServicer):
    """``tokenizer``: the replicas' tokenizer, to route text and chat prompts
    by their token ids (None: those route by load; token-id prompts by prefix)."""

    def __init__(self, replicas: ReplicaSet, tokenizer: Any | None = None) -> None:
        self.replicas = replicas
        self.policy: RoutingPolicy = replicas.policy
        self.tokenizer = tokenizer
        self.retried = 0

    def prompt(self, params: pb.GenerationParams) -> Prompt | None:
        """What cache-aware routing hashes; None when it cannot know the ids."""
        if self.policy.config.policy != "cache-aware":
            return None
        kind = params.WhichOneof("prompt")
        if kind == "token_ids":
            return Prompt(list(params.token_ids.ids), _cache_namespace(params))
        if kind is None or self.tokenizer is None:
            return None
        try:
            return Prompt(render_prompt(params, self.tokenizer, _LENIENT, path="params"), _cache_namespace(params))
        except InvalidRequestError:
            return None          # the replica says what is wrong

    def pick(self, prompt: Prompt | None, tried: list[Replica], *, generation: bool = True) -> Replica | None:
        """The replica for the next attempt (None: no serving one left)."""
        candidates = [r for r in self.replicas.serving() if r not in tried]
        if not candidates:
            return None
        choice = self.policy.choose([r.candidate() for r in candidates], prompt)
        replica = next(r for r in candidates if r.target == choice.name)
        if generation:
            assert replica.info is not None
            self.policy.record(replica.target, replica.info.block_size, prompt)
            replica.routed += 1
            replica.prefix_routed += choice.reason == "prefix"
        log.debug("route -> %s (%s, %d blocks matched)", choice.name, choice.reason, choice.matched_blocks)
        return replica

    async def _next_replica(self, context: grpc.aio.ServicerContext, prompt: Prompt | None,
                            tried: list[Replica], last: grpc.aio.AioRpcError | None,
                            generation: bool = True) -> Replica:
        replica = self.pick(prompt, tried, generation=generation)
        if replica is not None:
            if tried:
                self.retried += 1
                log.info("retrying on %s: %s answered UNAVAILABLE before streaming", replica.target,
                         tried[-1].target)
            return replica
        if last is not None:     # nowhere else to go: the replica's own answer
            await context.abort(last.code(), last.details() or "")
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"no healthy replica ({self.replicas.problems() or 'none configured'})")
        raise AssertionError("unreachable")

    async def GenerateStream(self, request: pb.GenerateStreamRequest,  # type: ignore[override]
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateStreamResponse]:
        prompt = self.prompt(request.params)
        tried: list[Replica] = []
        last: grpc.aio.AioRpcError | None = None
        while True:
            replica = await self._next_replica(context, prompt, tried, last)
            tried.append(replica)
            call = replica.stub.GenerateStream(request, timeout=context.time_remaining(),
                                               metadata=forwarded_metadata(context))
            streamed = False
            replica.in_flight += 1
            try:
                async for response in call:
                    streamed = True
                    yield response
                return
            except grpc.aio.AioRpcError as err:
                if not self._retryable(err, replica, streamed, tried):
                    await context.abort(err.code(), err.details() or "")
                last = err
            finally:
                replica.in_flight -= 1
                call.cancel()        # no-op once ended; else the client went away: stop the replica

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        response: pb.GenerateResponse = await self._unary("Generate", request, context,
                                                          self.prompt(request.params))
        return response

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        response: pb.TokenizeResponse = await self._unary("Tokenize", request, context, None, False)
        return response

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        response: pb.GetModelInfoResponse = await self._unary("GetModelInfo", request, context, None, False)
        return response

    async def _unary(self, method: str, request: Any, context: grpc.aio.ServicerContext,
                     prompt: Prompt | None, generation: bool = True) -> Any:
        tried: list[Replica] = []
        last: grpc.aio.AioRpcError | None = None
        while True:
            replica = await self._next_replica(context, prompt, tried, last, generation)
            tried.append(replica)
            call = getattr(replica.stub, method)(request, timeout=context.time_remaining(),
                                                 metadata=forwarded_metadata(context))
            replica.in_flight += generation
            try:
                return await call
            except grpc.aio.AioRpcError as err:
                if not self._retryable(err, replica, False, tried):
                    await context.abort(err.code(), err.details() or "")
                last = err
            finally:
                replica.in_flight -= generation
                call.cancel()

    def _retryable(self, err: grpc.aio.AioRpcError, replica: Replica, streamed: bool,
                   tried: list[Replica]) -> bool:
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        replica.mark_down(f"UNAVAILABLE: {err.details()}")
        return not streamed and len(tried) == 1

    async def GetServerStats(self, request: pb.GetServerStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetServerStatsResponse:
        remaining = context.time_remaining()
        timeout = self.replicas.timeout if remaining is None else min(remaining, self.replicas.timeout)
        metadata = forwarded_metadata(context)

        async def ask(r: Replica) -> pb.GetServerStatsResponse | grpc.aio.AioRpcError:
            try:
                stats: pb.GetServerStatsResponse = await r.stub.GetServerStats(request, timeout=timeout,
                                                                               metadata=metadata)
                return stats
            except grpc.aio.AioRpcError as err:
                return err

        answers = await asyncio.gather(*(ask(r) for r in self.replicas))
        if all(isinstance(a, grpc.aio.AioRpcError) for a in answers):
            first = answers[0]
            assert isinstance(first, grpc.aio.AioRpcError)
            await context.abort(first.code(), f"no replica answered: {first.details()}")
        return self._stats_reply(answers)

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoadLoraAdapterResponse:
        try:
            return await load_everywhere(list(self.replicas), request, forwarded_metadata(context),
                                         context.time_remaining())
        except AdminFailure as failure:
            await context.abort(failure.code, failure.details)
            raise AssertionError("unreachable") from None

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> pb.UnloadLoraAdapterResponse:
        try:
            return await unload_everywhere(list(self.replicas), request, forwarded_metadata(context),
                                           context.time_remaining())
        except AdminFailure as failure:
            await context.abort(failure.code, failure.details)
            raise AssertionError("unreachable") from None

    def _stats_reply(self, answers: list[pb.GetServerStatsResponse | grpc.aio.AioRpcError]
                     ) -> pb.GetServerStatsResponse:
        total = pb.GetServerStatsResponse(router_retried_requests=self.retried)
        for replica, answer in zip(self.replicas, answers):
            entry = pb.ReplicaStats(target=replica.target, serving=replica.serving,
                                    routed_requests=replica.routed,
                                    prefix_routed_requests=replica.prefix_routed,
                                    in_flight=replica.in_flight)
            if isinstance(answer, grpc.aio.AioRpcError):
                entry.error = f"{answer.code().name}: {answer.details()}"
            else:
                entry.stats.CopyFrom(answer)
                for name in SUMMED_STATS:
                    setattr(total, name, getattr(total, name) + getattr(answer, name))
            total.replicas.append(entry)
        return total


async def keep_health(replicas: ReplicaSet, health_servicer: health.aio.HealthServicer,
                      service_name: str, interval: float) -> None:
    """Poll every replica each ``interval`` seconds; the router is SERVING
    while at least one replica is."""
    from grpc_health.v1 import health_pb2

    current = None
    while True:
        serving = await replicas.poll_all()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != current:
            log.info("router health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            await health_servicer.set("", status)
            await health_servicer.set(service_name, status)
            current = status
        await asyncio.sleep(interval)


def _cache_namespace(params: pb.GenerationParams) -> str:
    """The prefix tables' namespace: the salt, and the LoRA adapter (a replica's
    cache never shares blocks across adapters, so neither may the routing)."""
    return params.cache_salt + (f"\0lora:{params.lora_adapter}" if params.lora_adapter else "")

"""API keys on the gRPC port: the interceptor, the caller's key name, and the
per-key limit on requests in flight (shared by both doors).

Why an interceptor, not a check in each handler: it sees every method of
every service the server has, so no jitney.v1 method (today's or a future
one) can forget the check; only the services listed in ``OPEN_SERVICES`` go
through without a key. It decides before any handler runs (from the call's
metadata), and an unauthenticated request is not even parsed. The one thing
it hands the handlers is the key's *name*, through ``caller_key``: it wraps
the handler so the name is set inside the call's own task (every call runs
in a task of its own, so the value never leaks to another call). Streaming is
no harder than unary: the wrapper re-yields the handler's messages and
closes the handler's generator when it is closed itself.

The per-key limit is not here but in ``GenerationServicer.admit``, the path
both doors share: a request takes its key's slot when admitted and gives it
back when its ``RequestRecord`` ends, which both doors' handlers guarantee in
a ``finally`` (finish, error, deadline, cancel, disconnect alike).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any

import grpc

from jitney.scheduler.security.tls import ApiKeys

log = logging.getLogger("jitney.scheduler")

# Open without a key: probes, and the schema (which is public anyway).
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
# One answer for a missing and a wrong key: it tells nothing about the keys.
UNAUTHENTICATED_MESSAGE = "a valid API key is required (metadata authorization: Bearer KEY)"

# The name of the key of the call being handled (None: keys are off).
caller_key: ContextVar[str | None] = ContextVar("jitney_caller_key", default=None)


def bearer_token(value: str | bytes | None) -> str | None:
    """The KEY of an ``authorization: Bearer KEY`` value, or None."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


class KeyLimitError(Exception):
    """A key already has its most requests in flight."""


class KeyLimiter:
    """Requests in flight per key name, at most ``limit`` (None: unlimited).
    Used from the event loop only."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._in_flight: Counter[str] = Counter()

    def in_flight(self, key: str) -> int:
        return self._in_flight[key]

    def acquire(self, key: str | None) -> Callable[[], None]:
        """Take a slot of ``key``; the function that gives it back (once, however
        often it is called). Raises KeyLimitError when the key has none free."""
        if key is None or self.limit is None:
            return _nothing
        if self._in_flight[key] >= self.limit:
            raise KeyLimitError(f"API key {key!r} already has {self.limit} requests in flight "
                                f"(--max-requests-per-key {self.limit}); retry when one ends")
        self._in_flight[key] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_flight[key] -= 1
                if not self._in_flight[key]:
                    del self._in_flight[key]
        return release


def _nothing() -> None:
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known key (UNAUTHENTICATED), except to ``OPEN_SERVICES``;
    ``on_refused(method, peer, why)`` is told of each refusal (never the key)."""

    def __init__(self, keys: ApiKeys, on_refused: Callable[[str, str, str], None]) -> None:
        self._keys = keys
        self._on_refused = on_refused

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        service = details.method.lstrip("/").rpartition("/")[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        sent = _authorization(details.invocation_metadata)  # type: ignore[attr-defined]
        name = self._keys.identify(bearer_token(sent))
        if name is None:
            why = "no key" if sent is None else "a key that matches none"
            return _refusing(handler, lambda peer: self._on_refused(details.method, peer, why))
        return _as_caller(handler, name)


def _kind(handler: grpc.RpcMethodHandler) -> tuple[str, Any]:
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return kind, behavior
    raise ValueError("a method handler without a behavior")


_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _refusing(handler: grpc.RpcMethodHandler, refused: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that aborts UNAUTHENTICATED; the request stays bytes."""
    kind, _ = _kind(handler)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        refused(context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await unary(request, context)
        yield None     # never reached: makes this an async generator, as grpc wants

    behavior = stream if kind.endswith("_stream") else unary
    return _FACTORIES[kind](behavior, request_deserializer=None,
                            response_serializer=handler.response_serializer)


def _as_caller(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """``handler``, run with ``caller_key`` set to ``name``."""
    kind, behavior = _kind(handler)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        caller_key.set(name)
        return await behavior(request, context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        caller_key.set(name)
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    wrapped = stream if kind.endswith("_stream") else unary
    return _FACTORIES[kind](wrapped, request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)

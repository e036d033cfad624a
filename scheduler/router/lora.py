"""LoRA adapters through `jitney router`: a request for an adapter may be
routed to any replica, so every replica must serve the same adapters.
LoadLoraAdapter and UnloadLoraAdapter therefore go to every configured
replica at once, serving or not (one out of rotation now would come back
without the adapter), with the caller's metadata (its API key: the
replicas check it) and deadline:

    call               every replica accepts      any replica refuses (or is unreachable)
    LoadLoraAdapter    the first replica's answer  the load is undone (UnloadLoraAdapter) on the
                                                   replicas that accepted it; the call ends with the
                                                   first refusing replica's code, its details after
                                                   the replica's address, naming where it was undone
                                                   and any undo that failed (unload it there)
    UnloadLoraAdapter  OK                          not undone (where it went, new requests for the
                                                   adapter are already refused); the first refusing
                                                   replica's code and details, naming the replicas
                                                   that did unload it

Both run shielded from the caller's cancellation, so a client that goes away
mid-load cannot leave a half-done load without its undo. A replica that
answered DEADLINE_EXCEEDED may have loaded the adapter after all: it is not
undone there (the details say which replica timed out).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from jitney.scheduler.router.replicas import Metadata, Replica
from jitney.v1 import generation_pb2 as pb

log = logging.getLogger("jitney.router")

UNDO_TIMEOUT = 10.0      # seconds for each undo, whatever the caller's deadline left


class AdminFailure(Exception):
    """How the call ends: a replica's status code and the router's details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


async def load_everywhere(replicas: Sequence[Replica], request: pb.LoadLoraAdapterRequest, metadata: Metadata,
                          timeout: float | None) -> pb.LoadLoraAdapterResponse:
    """Load on every replica, or on none (AdminFailure)."""
    answer = await asyncio.shield(_load(list(replicas), request, metadata, timeout))
    if isinstance(answer, AdminFailure):
        raise answer
    return answer


async def unload_everywhere(replicas: Sequence[Replica], request: pb.UnloadLoraAdapterRequest,
                            metadata: Metadata, timeout: float | None) -> pb.UnloadLoraAdapterResponse:
    """Unload from every replica; AdminFailure if any refused."""
    answer = await asyncio.shield(_unload(list(replicas), request, metadata, timeout))
    if isinstance(answer, AdminFailure):
        raise answer
    return answer


# (_load and _unload return their failure rather than raise it: a shielded task
# whose caller was cancelled would leave an exception no one retrieves.)

async def _load(replicas: list[Replica], request: pb.LoadLoraAdapterRequest, metadata: Metadata,
                timeout: float | None) -> pb.LoadLoraAdapterResponse | AdminFailure:
    answers = await _each(replicas, "LoadLoraAdapter", request, metadata, timeout)
    failed = [(r, a) for r, a in zip(replicas, answers) if isinstance(a, grpc.aio.AioRpcError)]
    if not failed:
        reply: pb.LoadLoraAdapterResponse = answers[0]
        return reply
    loaded = [r for r, a in zip(replicas, answers) if not isinstance(a, grpc.aio.AioRpcError)]
    undo = pb.UnloadLoraAdapterRequest(lora_name=request.lora_name)
    undone = await _each(loaded, "UnloadLoraAdapter", undo, metadata, UNDO_TIMEOUT)
    replica, err = failed[0]
    details = f"replica {replica.target}: {err.details()}"
    if ok := [r.target for r, a in zip(loaded, undone) if not isinstance(a, grpc.aio.AioRpcError)]:
        details += f"; the load was undone on {', '.join(ok)}"
    for r, a in zip(loaded, undone):
        if isinstance(a, grpc.aio.AioRpcError):
            log.warning("LoRA adapter %r: loaded on %s, and its undo failed (%s: %s)", request.lora_name,
                        r.target, a.code().name, a.details())
            details += (f"; it could not be undone on {r.target} ({a.code().name}: {a.details()}): "
                        "unload it there")
    return AdminFailure(err.code(), details)


async def _unload(replicas: list[Replica], request: pb.UnloadLoraAdapterRequest, metadata: Metadata,
                  timeout: float | None) -> pb.UnloadLoraAdapterResponse | AdminFailure:
    answers = await _each(replicas, "UnloadLoraAdapter", request, metadata, timeout)
    failed = [(r, a) for r, a in zip(replicas, answers) if isinstance(a, grpc.aio.AioRpcError)]
    if not failed:
        return pb.UnloadLoraAdapterResponse()
    replica, err = failed[0]
    details = f"replica {replica.target}: {err.details()}"
    if done := [r.target for r, a in zip(replicas, answers) if not isinstance(a, grpc.aio.AioRpcError)]:
        details += f"; it was unloaded from {', '.join(done)}"
    return AdminFailure(err.code(), details)


async def _each(replicas: list[Replica], method: str, request: Any, metadata: Metadata,
                timeout: float | None) -> list[Any]:
    """``method`` on every replica at once: each one's answer or its AioRpcError."""
    async def call(replica: Replica) -> Any:
        try:
            return await getattr(replica.stub, method)(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            return err

    return list(await asyncio.gather(*(call(r) for r in replicas)))

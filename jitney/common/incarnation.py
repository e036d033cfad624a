"""Worker incarnations: which worker process a frame of the engine link is from, or for.

A worker draws one at start and stamps it on every message it sends; its
plan socket (a DEALER) connects with the incarnation's routing id, and the
scheduler's ROUTER addresses plans to the incarnation it serves. See
``protos/jitney/engine/v1/engine.proto`` ("Incarnations").

    incarnation   64 random bits but the top byte, which is 1..255
    routing id    the incarnation as 8 big-endian bytes (ZeroMQ reserves
                  routing ids that begin with a zero byte)
"""

from __future__ import annotations

import secrets

_TOP_SHIFT = 56


def new_incarnation() -> int:
    """A fresh random incarnation (never 0; its routing id is valid)."""
    return (1 + secrets.randbelow(255)) << _TOP_SHIFT | secrets.randbits(_TOP_SHIFT)


def is_valid(incarnation: int) -> bool:
    """Whether ``incarnation`` is one a worker may draw."""
    return 0 < incarnation >> _TOP_SHIFT < 256


def routing_id(incarnation: int) -> bytes:
    """The ZeroMQ routing id of the worker with this incarnation."""
    return incarnation.to_bytes(8, "big")

"""Polling until something holds: a predicate (``wait_for``), a real server's
KV cache and seats empty again (``wait_idle``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from jitney.v1 import generation_pb2 as pb
from jitney.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tests.support.server_harness import Server


def wait_for(predicate: Callable[[], object], timeout: float = 15.0, what: str = "timed out",
             interval: float = 0.02) -> None:
    """Poll ``predicate`` every ``interval`` s until it is true; fail the test
    (``what``) if it is not within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(interval)


def wait_idle(server: Server, timeout: float = 10.0) -> pb.GetServerStatsResponse:
    """The server's stats once no KV block is used and nothing runs, or at
    ``timeout`` whatever they are (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(server.target) as channel:   # one channel for all the polls
        stub = pb_grpc.GenerationServiceStub(channel)
        while True:
            stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
            if (stats.kv_blocks_used == 0 and stats.requests_running == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

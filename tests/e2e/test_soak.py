"""Fault-injection soak over real processes (see tests/support/soak_load.py).

`jitney serve` on a tiny random model with a small KV cache (preemptions
happen), with its standby worker (the CPU default), a concurrent mix of
calls, and the worker SIGKILLed every few seconds for 60 s: kills that come
after a standby is loaded are taken over by it, closer ones get a fresh
process. Every call must end in one outcome its kind allows, greedy outputs
must match a fault-free run, and afterwards the server must be SERVING with
no block in use. A longer run: `python bench/soak.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tests.support.server_harness import health_status, running_server
from tests.support.soak_load import FINISHED, Soak, greedy_jobs, stream_tokens, wait_drained, wait_serving
from tests.support.tiny_models import make_tiny_llama
from jitney.common.background import may_leave_idle_policy

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--num-blocks", "40", "--block-size", "16", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "64", "--max-queued-requests", "12",
               "--worker-timeout", "3", "--dtype", "float32"]
KILL_SECONDS = 60.0


def test_soak_with_worker_kills(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", max_position_embeddings=4096)
    with running_server(["--model", str(model), *SERVER_ARGS], tmp_path, standby=True) as server:
        jobs = greedy_jobs(10)
        reference = {job: stream_tokens(server, job.params()) for job in jobs}   # alone
        soak = Soak(server, jobs, reference)
        # Short pauses (a fresh process takes over) and long ones (the standby,
        # started 5 s after a worker serves and then loaded, takes over).
        counts = soak.run(clients=12, kills=None, duration=KILL_SECONDS, between=(1.0, 1.0, 9.0),
                          max_calls_per_client=100_000)
        recoveries = sorted(soak.recoveries)
        print("\nsoak outcomes:", dict(sorted(counts.items())), f"\n{len(soak.kills)} worker kills; "
              f"kill to SERVING p50 {recoveries[len(recoveries) // 2]:.2f} s, max {recoveries[-1]:.2f} s")
        assert soak.problems() == []
        assert len(soak.kills) >= 8
        log = server.log()
        assert "restarting it now" in log, log[-3000:]
        if may_leave_idle_policy():
            # A standby that loads at idle priority starts 5 s after a worker serves;
            # one that cannot waits for a quiet moment, which this load never gives.
            assert "activated the standby worker" in log, log[-3000:]
        results = {o.result for o in soak.outcomes}
        for needed in (FINISHED, "cancelled", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT",
                       "RESOURCE_EXHAUSTED", "UNAVAILABLE"):
            assert needed in results, (needed, counts)
        stats = wait_serving(server)
        assert stats.worker_restarts == len(soak.kills) and stats.worker_pid not in soak.kills
        stats = wait_drained(server)
        assert (stats.kv_blocks_used, stats.requests_running, stats.requests_waiting) == (0, 0, 0)
        assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING
        # The restarted worker serves the same greedy outputs.
        assert stream_tokens(server, jobs[0].params()) == reference[jobs[0]]

"""Fault-injection soak over real processes (see tests/soak.py).

`jitney serve` on a tiny random model with a small KV cache (preemptions
happen), a concurrent mix of calls, and the worker SIGKILLed twice in the
middle. Every call must end in one outcome its kind allows, greedy outputs
must match a fault-free run, and afterwards the server must be SERVING with
no block in use. A longer run: `python bench/soak.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from bench.server_harness import health_status, running_server
from bench.soak_load import FINISHED, Soak, greedy_jobs, stream_tokens, wait_drained, wait_serving
from bench.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--num-blocks", "40", "--block-size", "16", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "64", "--max-queued-requests", "12",
               "--worker-timeout", "3", "--dtype", "float32"]


def test_soak_with_worker_kills(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", max_position_embeddings=4096)
    with running_server(["--model", str(model), *SERVER_ARGS], tmp_path) as server:
        jobs = greedy_jobs(10)
        reference = {job: stream_tokens(server, job.params()) for job in jobs}   # alone
        soak = Soak(server, jobs, reference)
        counts = soak.run(clients=12, kills=2)
        print("\nsoak outcomes:", dict(sorted(counts.items())), "worker kills:", soak.kills)
        assert soak.problems() == []
        assert len(soak.kills) == 2
        results = {o.result for o in soak.outcomes}
        for needed in (FINISHED, "cancelled", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT",
                       "RESOURCE_EXHAUSTED", "UNAVAILABLE"):
            assert needed in results, (needed, counts)
        stats = wait_serving(server)
        assert stats.worker_restarts == 2 and stats.worker_pid not in soak.kills
        stats = wait_drained(server)
        assert (stats.kv_blocks_used, stats.requests_running, stats.requests_waiting) == (0, 0, 0)
        assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING
        # The restarted worker serves the same greedy outputs.
        assert stream_tokens(server, jobs[0].params()) == reference[jobs[0]]

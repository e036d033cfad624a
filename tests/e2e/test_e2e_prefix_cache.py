"""Prefix caching end to end: two real servers on the tiny model, one with
the cache and one with ``--no-prefix-cache``, give the same greedy tokens."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from jitney.v1 import generation_pb2 as pb
from jitney.client.client import Sampling, make_params
from tests.support.server_harness import Server, health_status, running_server
from tests.support.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PREFIX = [(5 * i) % 250 + 3 for i in range(200)]          # 12 full blocks and 8 tokens


def serve_both(model: Path, logs: Path, stack: ExitStack) -> tuple[Server, Server]:
    """Start the two servers at once (start-up dominates the test's time)."""
    args = ["--model", str(model), "--num-blocks", "96", "--block-size", str(BLOCK_SIZE),
            "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--dtype", "float32"]
    on = stack.enter_context(running_server(args, logs, wait_serving=False))
    off = stack.enter_context(running_server([*args, "--no-prefix-cache"], logs, wait_serving=False))
    deadline = time.monotonic() + 240
    for srv in (on, off):
        while health_status(srv.target, 1.0) != health_pb2.HealthCheckResponse.SERVING:
            assert srv.proc.poll() is None and time.monotonic() < deadline, srv.log()
            time.sleep(0.2)
    return on, off


def generate(server: Server, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of ``prompt`` and its usage.cached_prompt_tokens."""
    params = make_params(prompt, sampling=Sampling(max_tokens=8, ignore_eos=True))
    msgs = list(server.stub().GenerateStream(pb.GenerateStreamRequest(params=params), timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage.cached_prompt_tokens


def run_workload(server: Server) -> list[tuple[list[int], int]]:
    """One request alone (fills the cache), then eight sharing its prefix at once."""
    first = generate(server, PREFIX + [7, 8, 9])
    prompts = [PREFIX + [11 + i] * (1 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        return [first, *pool.map(lambda p: generate(server, p), prompts)]


def test_shared_prefix_gives_the_same_tokens_with_and_without_the_cache(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    with ExitStack() as stack:
        on, off = serve_both(model, tmp_path_factory.mktemp("logs"), stack)
        with ThreadPoolExecutor(2) as pool:
            cached, uncached = pool.map(run_workload, (on, off))
        assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in uncached]
        assert all(n == 0 for _, n in uncached)
        assert cached[0][1] == 0
        assert all(n == 12 * BLOCK_SIZE for _, n in cached[1:])
        stats_on, stats_off = on.stats(), off.stats()
        assert stats_on.prefix_cache_hit_tokens >= 8 * 12 * BLOCK_SIZE
        assert stats_on.prefix_cache_queried_tokens >= sum(len(PREFIX) + 1 + i for i in range(8))
        assert (stats_off.prefix_cache_hit_tokens, stats_off.prefix_cache_queried_tokens) == (0, 0)
        assert stats_on.kv_blocks_used == 0 and stats_on.requests_running == 0

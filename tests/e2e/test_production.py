"""Production behaviour over real processes: queue bounds, deadlines,
priorities, the metrics endpoint, draining on SIGTERM.

Two seats (``--max-num-seqs 2``): two long streams fill them, so whatever is
sent next waits, and the tests can look at the queue.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from jitney.v1 import generation_pb2 as pb
from jitney.client.client import Sampling, make_params
from jitney.scheduler.core.admission import AdmissionLimits, QueueFullError
from tests.support.server_harness import Server, free_port, running_server
from tests.support.tiny_models import make_tiny_llama
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

MAX_QUEUED = 3
MAX_QUEUED_TOKENS = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    metrics_port = free_port()
    args = ["--model", str(model), "--num-blocks", "160", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "64", "--dtype", "float32",
            "--max-queued-requests", str(MAX_QUEUED), "--max-queued-tokens", str(MAX_QUEUED_TOKENS),
            "--metrics-port", str(metrics_port)]
    with running_server(args, tmp_path_factory.mktemp("logs")) as srv:
        srv.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield srv


def params(prompt: list[int], max_tokens: int, priority: int | None = None) -> pb.GenerationParams:
    p = make_params(prompt, sampling=Sampling(max_tokens=max_tokens, ignore_eos=True))
    if priority is not None:
        p.priority = priority
    return p


@contextmanager
def seats_taken(server: Server) -> Iterator[list]:
    """Two long streams hold both seats until the block ends."""
    calls = [server.stub().GenerateStream(pb.GenerateStreamRequest(params=params([3 + i, 4], 2000)),
                                          timeout=120) for i in range(2)]
    for call in calls:
        next(call)      # running now
    try:
        yield calls
    finally:
        for call in calls:
            call.cancel()
        wait_for(lambda: server.stats().requests_running == 0)


def test_admission_limits_unit() -> None:
    limits = AdmissionLimits(max_queued_requests=2, max_queued_tokens=10, max_request_seconds=5)
    limits.check(0, 0, 50)          # an empty queue takes any request
    with pytest.raises(QueueFullError, match="max-queued-requests"):
        limits.check(2, 0, 1)
    with pytest.raises(QueueFullError, match="max-queued-tokens"):
        limits.check(1, 6, 5)
    assert limits.time_limit(None) == 5 and limits.time_limit(2.5) == 2.5
    assert AdmissionLimits().time_limit(None) is None


def test_queue_bounds_answer_resource_exhausted(server: Server) -> None:
    stub = server.stub()
    with seats_taken(server):
        waiting = [stub.Generate.future(pb.GenerateRequest(params=params([9, i + 1], 4)), timeout=60)
                   for i in range(MAX_QUEUED)]
        wait_for(lambda: server.stats().requests_waiting == MAX_QUEUED)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(params=params([9, 9], 4)), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-requests" in err.value.details()
    assert [len(f.result().token_ids) for f in waiting] == [4] * MAX_QUEUED
    with seats_taken(server):
        big = stub.Generate.future(pb.GenerateRequest(params=params([5] * 200, 2)), timeout=60)
        wait_for(lambda: server.stats().requests_waiting == 1)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(params=params([6] * 150, 2)), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queued-tokens" in err.value.details()
    assert len(big.result().token_ids) == 2


def test_deadlines_end_running_and_waiting_requests(server: Server) -> None:
    stub = server.stub()
    call = stub.GenerateStream(pb.GenerateStreamRequest(params=params([3, 4, 5], 2000)), timeout=0.5)
    got = 0
    with pytest.raises(grpc.RpcError) as err:
        for msg in call:
            got += len(msg.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and got > 0
    with seats_taken(server):
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(params=params([7, 8], 4)), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: server.stats().requests_waiting == 0)
    wait_for(lambda: server.stats().kv_blocks_used == 0)


def test_higher_priority_boards_first(server: Server) -> None:
    stub = server.stub()
    done_order: list[str] = []
    lock = threading.Lock()

    def send(name: str, priority: int | None):
        fut = stub.Generate.future(pb.GenerateRequest(params=params([11, 12], 8, priority)), timeout=60)
        fut.add_done_callback(lambda _f: (lock.acquire(), done_order.append(name), lock.release()))
        return fut

    with seats_taken(server) as calls:
        low = send("low", None)
        wait_for(lambda: server.stats().requests_waiting == 1)
        high = send("high", 5)
        wait_for(lambda: server.stats().requests_waiting == 2)
        calls[0].cancel()           # one seat opens: the high one takes it
        high.result()
        assert not low.done()
    low.result()
    assert done_order == ["high", "low"]
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(pb.GenerateRequest(params=params([1], 2, priority=5000)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.priority" in err.value.details()


def test_metrics_endpoint(server: Server) -> None:
    stub = server.stub()
    stub.Generate(pb.GenerateRequest(params=params([1, 2, 3], 5)), timeout=30)
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"  # type: ignore[attr-defined]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for name in ["jitney:num_requests_running", "jitney:num_requests_waiting",
                 "jitney:kv_cache_usage_perc", "jitney:prefix_cache_queries_total",
                 "jitney:prefix_cache_hits_total", "jitney:num_preemptions_total",
                 "jitney:time_to_first_token_seconds_bucket",
                 "jitney:inter_token_latency_seconds_bucket",
                 "jitney:e2e_request_latency_seconds_bucket", "jitney:prompt_tokens_total",
                 "jitney:generation_tokens_total", "jitney:step_duration_seconds_bucket",
                 "jitney:batch_size_bucket"]:
        assert name in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert values['jitney:request_success_total{door="grpc",finished_reason="length"}'] >= 1
    assert values['jitney:generation_tokens_total{door="grpc"}'] >= 5
    assert values['jitney:prompt_tokens_total{door="grpc"}'] >= 3
    assert values["jitney:time_to_first_token_seconds_count"] >= 1
    assert "request " in server.log() and "finish=length" in server.log()


def test_sigterm_drains_running_requests_then_exits_0(model: Path, tmp_path: Path) -> None:
    args = ["--model", str(model), "--num-blocks", "160", "--dtype", "float32",
            "--drain-seconds", "20"]
    with running_server(args, tmp_path) as srv:
        call = srv.stub().GenerateStream(pb.GenerateStreamRequest(params=params([3, 4], 1500)),
                                         timeout=60)
        msgs = [next(call)]
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as err:
            srv.stub().Generate(pb.GenerateRequest(params=params([1, 2], 2)), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        msgs += list(call)
        assert sum(len(m.token_ids) for m in msgs) == 1500
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert srv.proc.wait(timeout=30) == 0, srv.log()
